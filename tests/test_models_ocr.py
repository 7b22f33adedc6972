"""The demo's OCR model: decoding and scoring (pure), captchas, and the graph edit."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from splitinfer.models import ocr

needs_ddddocr = pytest.mark.skipif(
    importlib.util.find_spec("ddddocr") is None, reason="needs the demo extra (ddddocr wheel)"
)
needs_captcha = pytest.mark.skipif(
    importlib.util.find_spec("captcha") is None, reason="needs the demo extra (captcha)"
)


@pytest.mark.unit
def test_ctc_decode_merges_repeats_and_drops_blanks() -> None:
    chars = ["", "A", "b", "c"]
    assert ocr.decode(np.array([[0, 1, 1, 0, 1, 2, 2, 3, 0]]), chars) == "aabc"
    assert ocr.decode(np.array([0, 0, 0]), chars) == ""
    assert ocr.decode(np.array([9, 1]), chars) == "a"  # out of range: dropped


@pytest.mark.unit
def test_char_accuracy_is_one_minus_edit_distance_over_length() -> None:
    assert ocr.edit_distance("kitten", "sitting") == 3
    assert ocr.char_accuracy(["abcd", "abd", "", "abcdxxxxx"], ["abcd"] * 4) == pytest.approx(
        (1 + 0.75 + 0 + 0) / 4
    )


@pytest.mark.unit
@needs_captcha
def test_captchas_are_reproducible_from_the_seed() -> None:
    a, texts = ocr.make_captchas(3, seed=5)
    b, again = ocr.make_captchas(3, seed=5)
    c, _ = ocr.make_captchas(3, seed=6)
    assert a.shape == (3, 1, ocr.HEIGHT, ocr.WIDTH)
    assert a.dtype == np.float32
    assert texts == again
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)
    assert all(len(t) == ocr.TEXT_LENGTH and set(t) <= set(ocr.ALPHABET) for t in texts)
    assert a.min() >= 0.0
    assert a.max() <= 1.0


@pytest.mark.integration
@needs_ddddocr
@needs_captcha
def test_export_adds_a_verified_argmax_head_and_reads_captchas(tmp_path: Path) -> None:
    import onnx

    from splitinfer.shared.ortsession import open_session

    model = ocr.export_ocr(tmp_path / "ocr.onnx")
    graph = onnx.load(str(model)).graph
    assert [o.name for o in graph.output] == [ocr.OUTPUT_NAME]
    assert graph.input[0].type.tensor_type.shape.dim[3].dim_value == ocr.WIDTH
    x, texts = ocr.make_captchas(12, seed=3)
    ocr.verify_export(model, x)
    out = open_session(model).run(None, {ocr.INPUT_NAME: x})[0]
    assert out.dtype == np.int64
    assert out.shape[0] == len(x)
    chars = ocr.charset()
    preds = [ocr.decode(row, chars) for row in out]
    assert ocr.char_accuracy(preds, texts) > 0.6  # the trained weights read them
