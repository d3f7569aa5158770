"""Logs what a run of accel's main job logged (its configuration and its metrics.jsonl) with
the wandb client itself, offline (WANDB_MODE=offline, WANDB_DIR set by the caller), for the
test that compares accel's W&B run file with the client's: same reader, same content.

    WANDB_MODE=offline WANDB_DIR=/tmp/x .venv/bin/python python/reference/wandb_offline.py \
        digits config.json runs/digits/metrics.jsonl
"""
import json
import sys

import wandb

project, config_path, metrics_path = sys.argv[1:4]
with open(config_path) as f:
    config = json.load(f)
run = wandb.init(project=project, config=config)
with open(metrics_path) as f:
    for line in f:
        record = json.loads(line)
        step = record.pop("step")
        # Numbers only (metrics.jsonl points at media files with objects).
        numbers = {k: v for k, v in record.items() if isinstance(v, (int, float))}
        if numbers:
            run.log(numbers, step=step)
run.finish()
print(run.dir)
