"""Calibration data: loading .npy/.npz folders, every error case, synthetic feeds, hold-out."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from splitinfer.partitioner.calibration import (
    SYNTH_FREE_DIM,
    SYNTH_INT_HIGH,
    load_calibration,
    split_holdout,
    synthetic_calibration,
)
from splitinfer.shared.errors import ConfigError
from splitinfer.shared.manifest import TensorSpec

pytestmark = pytest.mark.unit

IMAGE = TensorSpec("x", "float32", ("batch", 3, 4, 4))
IDS = TensorSpec("ids", "int64", ("batch", "seq"))
MASK = TensorSpec("mask", "int64", ("batch", "seq"))


def rand(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_npy_single_samples_and_batches_load_in_file_name_order(tmp_path: Path) -> None:
    one, batch = rand(3, 4, 4, seed=1), rand(5, 3, 4, 4, seed=2)
    np.save(tmp_path / "b.npy", one)  # one sample, no batch axis
    np.save(tmp_path / "a.npy", batch)  # a batch of five
    (tmp_path / "notes.txt").write_text("ignored")
    feeds = load_calibration(tmp_path, [IMAGE], "batch")
    assert len(feeds) == 6
    assert all(set(f) == {"x"} and f["x"].shape == (1, 3, 4, 4) for f in feeds)
    np.testing.assert_array_equal(feeds[0]["x"][0], batch[0])  # a.npy first
    np.testing.assert_array_equal(feeds[4]["x"][0], batch[4])
    np.testing.assert_array_equal(feeds[5]["x"][0], one)


def test_limit_caps_the_number_of_feeds(tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", rand(5, 3, 4, 4))
    np.save(tmp_path / "b.npy", rand(5, 3, 4, 4))
    assert len(load_calibration(tmp_path, [IMAGE], "batch", limit=7)) == 7
    with pytest.raises(ConfigError, match="limit 0 must be at least 1"):
        load_calibration(tmp_path, [IMAGE], "batch", limit=0)


def test_npz_keyed_by_input_name_with_symbolic_dims(tmp_path: Path) -> None:
    ids = np.arange(24, dtype=np.int64).reshape(2, 12)
    mask = np.ones((2, 12), dtype=np.int64)
    np.savez(tmp_path / "s.npz", ids=ids, mask=mask, extra=np.zeros(3))
    np.savez(tmp_path / "t.npz", ids=np.arange(5, dtype=np.int64), mask=np.ones(5, np.int64))
    feeds = load_calibration(tmp_path, [IDS, MASK], "batch")
    assert [f["ids"].shape for f in feeds] == [(1, 12), (1, 12), (1, 5)]
    np.testing.assert_array_equal(feeds[1]["ids"][0], ids[1])
    assert all(f["mask"].dtype == np.int64 for f in feeds)


def test_safe_casts_only(tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", rand(2, 3, 4, 4).astype(np.float64))
    feeds = load_calibration(tmp_path, [IMAGE], "batch")
    assert feeds[0]["x"].dtype == np.float32  # float64 files are common; narrowed

    ints = tmp_path / "ints"
    ints.mkdir()
    np.savez(ints / "a.npz", ids=np.ones((1, 4), np.int32), mask=np.ones((1, 4), np.uint8))
    feed = load_calibration(ints, [IDS, MASK], "batch")[0]
    assert feed["ids"].dtype == np.int64
    assert feed["mask"].dtype == np.int64

    floats = tmp_path / "floats"
    floats.mkdir()
    np.savez(floats / "a.npz", ids=np.ones((1, 4), np.float32), mask=np.ones((1, 4), np.int64))
    with pytest.raises(ConfigError, match=r"'ids' is int64, the file holds float32"):
        load_calibration(floats, [IDS, MASK], "batch")


def test_unbatched_input_takes_whole_values(tmp_path: Path) -> None:
    table = TensorSpec("table", "float32", (4, 2))
    np.save(tmp_path / "a.npy", rand(3, 4, 2))  # three values stacked
    feeds = load_calibration(tmp_path, [table], None)
    assert [f["table"].shape for f in feeds] == [(4, 2)] * 3


def test_fixed_batch_of_one_counts_as_batch_axis(tmp_path: Path) -> None:
    spec = TensorSpec("x", "float32", (1, 3, 4, 4))
    np.save(tmp_path / "a.npy", rand(4, 3, 4, 4))
    feeds = load_calibration(tmp_path, [spec], None)
    assert [f["x"].shape for f in feeds] == [(1, 3, 4, 4)] * 4


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"calibration folder .*nope does not exist"):
        load_calibration(tmp_path / "nope", [IMAGE], "batch")


def test_a_file_instead_of_a_folder(tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", rand(3, 4, 4))
    with pytest.raises(ConfigError, match="is not a folder"):
        load_calibration(tmp_path / "a.npy", [IMAGE], "batch")


def test_empty_folder(tmp_path: Path) -> None:
    (tmp_path / "readme.md").write_text("no samples here")
    with pytest.raises(ConfigError, match=r"holds no \.npy or \.npz files"):
        load_calibration(tmp_path, [IMAGE], "batch")


def test_unreadable_file(tmp_path: Path) -> None:
    (tmp_path / "a.npy").write_bytes(b"not numpy at all")
    with pytest.raises(ConfigError, match=r"a\.npy: cannot be read as \.npy"):
        load_calibration(tmp_path, [IMAGE], "batch")
    (tmp_path / "a.npy").unlink()
    (tmp_path / "b.npz").write_bytes(b"PK not a zip")
    with pytest.raises(ConfigError, match=r"b\.npz: cannot be read as \.npz"):
        load_calibration(tmp_path, [IMAGE], "batch")


def test_pickled_object_arrays_are_refused(tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", np.array([{"x": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ConfigError, match=r"a\.npy: cannot be read"):
        load_calibration(tmp_path, [IMAGE], "batch")


def test_wrong_shape_names_file_input_expected_and_got(tmp_path: Path) -> None:
    np.save(tmp_path / "bad.npy", rand(2, 3, 5, 4))
    with pytest.raises(
        ConfigError,
        match=r"bad\.npy: input 'x' expects one sample of shape \[3, 4, 4\] or a batch "
        r"\[n, 3, 4, 4\], got \[2, 3, 5, 4\]",
    ):
        load_calibration(tmp_path, [IMAGE], "batch")


def test_wrong_rank(tmp_path: Path) -> None:
    np.save(tmp_path / "flat.npy", rand(48))
    with pytest.raises(ConfigError, match=r"flat\.npy: input 'x' .* got \[48\]"):
        load_calibration(tmp_path, [IMAGE], "batch")


def test_missing_input_key(tmp_path: Path) -> None:
    np.savez(tmp_path / "s.npz", ids=np.ones((1, 4), np.int64), masks=np.ones((1, 4), np.int64))
    with pytest.raises(
        ConfigError, match=r"s\.npz: no array for input 'mask' \(keys: 'ids', 'masks'\)"
    ):
        load_calibration(tmp_path, [IDS, MASK], "batch")


def test_npy_for_a_two_input_model(tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", np.ones((1, 4), np.int64))
    with pytest.raises(ConfigError, match=r"a \.npy file holds one array but the model has 2"):
        load_calibration(tmp_path, [IDS, MASK], "batch")


def test_inputs_with_different_sample_counts(tmp_path: Path) -> None:
    np.savez(tmp_path / "s.npz", ids=np.ones((3, 4), np.int64), mask=np.ones((2, 4), np.int64))
    with pytest.raises(ConfigError, match=r"different numbers of samples \(ids: 3, mask: 2\)"):
        load_calibration(tmp_path, [IDS, MASK], "batch")


def test_synthetic_values_follow_dtype_and_name() -> None:
    feeds = synthetic_calibration([IMAGE, IDS, MASK], n=6, seed=3, overrides=None)
    assert len(feeds) == 6
    for f in feeds:
        assert f["x"].shape == (1, 3, 4, 4)
        assert f["x"].dtype == np.float32
        assert f["ids"].shape == (1, SYNTH_FREE_DIM)
        assert f["ids"].dtype == np.int64
        assert f["ids"].min() >= 0
        assert f["ids"].max() < SYNTH_INT_HIGH
        assert set(np.unique(f["mask"])) <= {0, 1}
        assert f["mask"][0, 0] == 1
    xs = np.concatenate([f["x"] for f in feeds])
    assert abs(float(xs.mean())) < 0.2
    assert 0.8 < float(xs.std()) < 1.2
    again = synthetic_calibration([IMAGE, IDS, MASK], n=6, seed=3, overrides=None)
    np.testing.assert_array_equal(feeds[2]["x"], again[2]["x"])  # seeded
    other = synthetic_calibration([IMAGE], n=1, seed=4, overrides=None)
    assert not np.array_equal(feeds[0]["x"], other[0]["x"])


def test_synthetic_overrides_fill_symbolic_dims() -> None:
    feeds = synthetic_calibration([IDS], n=2, seed=0, overrides={"ids": (1, 16)})
    assert feeds[0]["ids"].shape == (1, 16)
    with pytest.raises(ConfigError, match=r"override \[1, 16\] has rank 2, the input has rank 4"):
        synthetic_calibration([IMAGE], n=1, seed=0, overrides={"x": (1, 16)})
    with pytest.raises(ConfigError, match="sets axis 1 to 4, the model fixes it to 3"):
        synthetic_calibration([IMAGE], n=1, seed=0, overrides={"x": (1, 4, 4, 4)})
    with pytest.raises(ConfigError, match="at least 1 sample"):
        synthetic_calibration([IMAGE], n=0, seed=0, overrides=None)


def test_split_holdout_is_a_seeded_partition() -> None:
    samples = [{"x": np.full((1, 1), i, np.float32)} for i in range(10)]
    calib, held = split_holdout(samples, fraction=0.3, seed=1)
    assert len(calib) == 7
    assert len(held) == 3
    ids = sorted(int(f["x"][0, 0]) for f in calib + held)
    assert ids == list(range(10))
    again = split_holdout(samples, fraction=0.3, seed=1)[1]
    assert [int(f["x"][0, 0]) for f in again] == [int(f["x"][0, 0]) for f in held]
    two = split_holdout(samples[:2], fraction=0.01)
    assert len(two[0]) == 1
    assert len(two[1]) == 1
    with pytest.raises(ConfigError, match="at least 2 are needed"):
        split_holdout(samples[:1])
    with pytest.raises(ConfigError, match=r"fraction 1\.0 must be between 0 and 1"):
        split_holdout(samples, fraction=1.0)
