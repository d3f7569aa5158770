"""Reads a Weights & Biases offline run (`wandb/offline-run-*/run-*.wandb`) with the wandb
package's own reader (its DataStore and its protobuf classes; nothing is uploaded), for the
test of accel's W&B tracker: prints one JSON object with the records' kinds in order, the
run record, every history row, the summary (every summary record applied in order) and the
exit code.

    .venv/bin/python python/reference/read_wandb.py wandb/offline-run-20261205_120000-abc123
"""
import glob
import json
import os
import sys

from google.protobuf.json_format import MessageToDict
from wandb.proto import wandb_internal_pb2 as pb
from wandb.sdk.internal import datastore


def records(path):
    ds = datastore.DataStore()
    ds.open_for_scan(path)
    try:
        while True:
            data = ds.scan_data()
            if data is None:
                return
            record = pb.Record()
            record.ParseFromString(data)
            yield record
    finally:
        ds.close()


def path_of(item):
    return ".".join(item.nested_key) if item.nested_key else item.key


(run_file,) = glob.glob(os.path.join(sys.argv[1], "run-*.wandb"))
out = {"kinds": [], "nums": [], "run": None, "history": [], "summary": {}, "exit_code": None}
for record in records(run_file):
    kind = record.WhichOneof("record_type")
    out["kinds"].append(kind)
    out["nums"].append(record.num)
    if kind == "run":
        run = MessageToDict(record.run, preserving_proto_field_name=True)
        run["config"] = {i.key: json.loads(i.value_json) for i in record.run.config.update}
        out["run"] = run
    elif kind == "config":
        for i in record.config.update:
            out["run"]["config"][i.key] = json.loads(i.value_json)
    elif kind == "history":
        row = {path_of(i): json.loads(i.value_json) for i in record.history.item}
        row["_history_step"] = record.history.step.num
        out["history"].append(row)
    elif kind == "summary":
        for i in record.summary.update:
            out["summary"][path_of(i)] = json.loads(i.value_json)
    elif kind == "exit":
        out["exit_code"] = record.exit.exit_code
print(json.dumps(out))
