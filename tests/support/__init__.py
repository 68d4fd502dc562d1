"""Helpers shared by tests of several folders (trainer callbacks, the tiny family cases)."""
