"""Reads a folder of TensorBoard event files with TensorBoard's own reader, for the test of
accel's TensorBoard tracker: prints one JSON object with every scalar series (step, value),
the images and texts (the text plugin's), and the hparams plugin's records (hyperparameter
values, the experiment's metric tags).

    .venv/bin/python python/reference/read_tensorboard.py runs/my_project
"""
import json
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

accumulator = EventAccumulator(
    sys.argv[1], size_guidance={"scalars": 0, "tensors": 0, "images": 0}
)
accumulator.Reload()
out = {"scalars": {}, "hparams": {}, "metrics": [], "ended": False, "images": {}, "text": {}}
for tag in accumulator.Tags()["scalars"]:
    out["scalars"][tag] = [[e.step, e.value] for e in accumulator.Scalars(tag)]
# Images: step, size and the PNG's bytes as hex; text: the text plugin's string tensors.
for tag in accumulator.Tags()["images"]:
    out["images"][tag] = [
        [e.step, e.width, e.height, e.encoded_image_string.hex()] for e in accumulator.Images(tag)
    ]
for tag in accumulator.PluginTagToContent("text"):
    out["text"][tag] = [
        [e.step, e.tensor_proto.string_val[0].decode()] for e in accumulator.Tensors(tag)
    ]
for tag, content in accumulator.PluginTagToContent("hparams").items():
    data = plugin_data_pb2.HParamsPluginData.FromString(content)
    if data.HasField("session_start_info"):
        for name, value in data.session_start_info.hparams.items():
            out["hparams"][name] = getattr(value, value.WhichOneof("kind"))
    if data.HasField("experiment"):
        out["metrics"] = sorted(m.name.tag for m in data.experiment.metric_infos)
    if data.HasField("session_end_info"):
        out["ended"] = data.session_end_info.status == 1
print(json.dumps(out))
