#!/usr/bin/env python
"""Serve registered flowgrpo rewards over HTTP (same as the `flowgrpo-reward-server` console script).

    FLOWGRPO_REWARD_TOKEN=s3cret python scripts/reward_server.py --rewards ocr --host 0.0.0.0 --port 8000

Then train with the `remote` reward: reward_kwargs={"remote": {"url": "http://<host>:8000", "reward_name": "ocr"}}.
"""

from flowgrpo.rewards.server import main

if __name__ == "__main__":
    main()
