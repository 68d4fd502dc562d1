"""The algorithms: each trainer in one file (its sampling record and loss), with its configuration and loss math."""
