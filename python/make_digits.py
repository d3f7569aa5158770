"""Converts scikit-learn's bundled copy of the UCI 8x8 handwritten digits (1,797 images,
sklearn/datasets/data/digits.csv.gz) into data/digits.safetensors, once; the result is
committed, so nobody needs scikit-learn to train on it.

    python -m venv /tmp/skl && /tmp/skl/bin/pip install scikit-learn safetensors numpy
    /tmp/skl/bin/python python/make_digits.py

Layout: train.x / test.x  uint8 [n, 64], pixel intensities 0..16 (row-major 8x8)
        train.y / test.y  int64 [n], the digit
A fixed permutation (numpy seed 0) puts 1,437 images in train and 360 in test.
"""
import numpy as np
from safetensors.numpy import save_file
from sklearn.datasets import load_digits

digits = load_digits()
x = digits.data.astype(np.uint8)
y = digits.target.astype(np.int64)
order = np.random.default_rng(0).permutation(len(y))
x, y = x[order], y[order]
n_test = 360
save_file(
    {
        "train.x": np.ascontiguousarray(x[n_test:]),
        "train.y": np.ascontiguousarray(y[n_test:]),
        "test.x": np.ascontiguousarray(x[:n_test]),
        "test.y": np.ascontiguousarray(y[:n_test]),
    },
    "data/digits.safetensors",
    metadata={"source": "scikit-learn load_digits (UCI optdigits test set), seed-0 split"},
)
print(f"wrote data/digits.safetensors: {len(y) - n_test} train, {n_test} test")
