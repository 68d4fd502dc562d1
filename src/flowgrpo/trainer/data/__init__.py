"""Prompt datasets, the grouped sampler, source images of editing families, the prompt-embedding cache."""
