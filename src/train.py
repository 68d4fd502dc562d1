"""Training from a YAML recipe with any trainer of the registry (the recipe's ``trainer:``, Flow-GRPO by default);
``--key value`` flags override the recipe.

    python src/train.py recipes/tiny_cpu.yaml --max_steps 2
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml src/train.py recipes/tiny_cpu.yaml --max_steps 2
    accelerate launch --config_file accelerate_configs/fsdp8.yaml src/train.py recipes/ocr.yaml

``python src/train.py --help`` lists every key. The same code is importable: ``flowgrpo.cli.parse_recipe`` and
``flowgrpo.cli.main``. Set ``FLOWGRPO_RANK_LOG_DIR=DIR`` to have every process write its own training records to
``DIR/rank<N>.jsonl`` (see ``flowgrpo.cli.train``).
"""

if __name__ == "__main__":
    from flowgrpo.process_gc import pause_until_training

    pause_until_training()  # the imports and the set-up with the garbage collector paused (flowgrpo.process_gc)
    from flowgrpo.cli import main

    main()
