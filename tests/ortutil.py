"""Running models with ONNX Runtime in tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from splitinfer.shared.ortsession import open_session


def session(model: onnx.ModelProto | Path) -> ort.InferenceSession:
    return open_session(model)


def run(model: onnx.ModelProto | Path, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    sess = session(model)
    names = [o.name for o in sess.get_outputs()]
    wanted = {i.name: feeds[i.name] for i in sess.get_inputs()}
    return dict(zip(names, sess.run(names, wanted), strict=True))


def compose(
    edge: onnx.ModelProto | Path, cloud: onnx.ModelProto | Path, feeds: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Run edge then cloud, joining them by tensor name, as the two daemons will."""
    return run(cloud, run(edge, feeds))


def assert_close(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    """The issue's bound: max abs error <= 1e-5 * max(1, |reference|), elementwise."""
    assert set(got) == set(want), f"outputs {sorted(got)} != {sorted(want)}"
    for name, ref in want.items():
        out = got[name]
        assert out.shape == ref.shape, f"{name}: shape {out.shape} != {ref.shape}"
        assert out.dtype == ref.dtype, f"{name}: dtype {out.dtype} != {ref.dtype}"
        bound = 1e-5 * np.maximum(1.0, np.abs(ref))
        err = np.abs(out.astype(np.float64) - ref)
        worst = float(np.max(err - bound)) if err.size else 0.0
        assert worst <= 0, f"{name}: error exceeds 1e-5*max(1,|ref|) by {worst:.3g}"
