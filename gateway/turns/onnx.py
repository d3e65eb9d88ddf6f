"""One ONNX model on onnxruntime's CPU provider, as the gateway's turn models load theirs."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def onnx_session(path: str | Path, what: str, threads: int = 1) -> Any:
    """An InferenceSession of `path` (a file, or a folder holding model.onnx), running its
    operators in order on `threads` threads; FileNotFoundError naming `what` if absent."""
    import onnxruntime as ort

    path = Path(path)
    if path.is_dir():
        path = path / "model.onnx"
    if not path.is_file():
        raise FileNotFoundError(f"no {what} at {path}")
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])
