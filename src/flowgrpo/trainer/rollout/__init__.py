"""The rollout and scoring pipeline: sampling, decoding, rewards and group advantages."""
