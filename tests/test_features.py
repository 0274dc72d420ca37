"""Target-feature pipeline: capture picks the right layers, the offline cache trains exactly like the
online target, mismatching/partial caches are refused, and a killed capture job resumes."""

from __future__ import annotations

import json
import os

import pytest
import torch

from conftest import compose, tiny_train_overrides
from draftheads.data_prep.dataset import prepare_data
from draftheads.data_prep.feature_cache import FeatureCache, FeatureDataset
from draftheads.data_prep.features import resolve_layers
from draftheads.heads.target import load_target

L = 4  # layers of the tiny targets in conftest


def _feature_cfg(target_dir, chat_file, data_cache, out, *extra):
    return compose("features", [
        "target=hf", f"target.name={target_dir}", "target.dtype=fp32", "target.local_files_only=true",
        "data=file", f"data.path={chat_file}", "data.max_length=64", "data.heldout_fraction=0.1",
        f"data.cache_dir={data_cache}", f"out={out}", "rows_per_shard=64", "batch_size=16", "device=cpu", *extra])


def _capture(tmp_path, target_dir, chat_file, name, *extra):
    from draftheads.data_prep.features import main

    out = tmp_path / name
    return main(_feature_cfg(target_dir, chat_file, tmp_path / "data-cache", out, *extra)), out


def _losses(out_dir) -> list[float]:
    return [json.loads(l)["loss"] for l in (out_dir / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(l)]


def _train(tmp_path, target_dir, chat_file, name, **kw):
    from draftheads.train.eagle import main

    kw = {"data.cache_dir": str(tmp_path / "data-cache"), "train.max_steps": 6, "optim.lr": 3e-3, **kw}
    return main(compose("eagle", tiny_train_overrides(target_dir, chat_file, tmp_path / name, **kw)))


def test_resolve_layers():
    assert resolve_layers([-1, 0, 2, 2], L) == [0, 2, L]
    with pytest.raises(ValueError, match="layer 5 outside"):
        resolve_layers([5], L)


def test_capture_picks_requested_layers_and_writes_manifest(tmp_path, tiny_target_dir, chat_file, capsys):
    summary, out = _capture(tmp_path, tiny_target_dir, chat_file, "feat", "layers=[0,2,-1]", "dtype=fp32")
    printed = capsys.readouterr().out
    m = json.loads((out / "manifest.json").read_text())
    assert m["layers"] == [0, 2, L] and m["dtype"] == "fp32" and m["complete"] is True
    assert m["target"]["hidden_size"] == 64 and m["target"]["num_layers"] == L and m["target"]["fingerprint"]
    assert m["bytes_per_token"] == 3 * 64 * 4
    assert f"{m['data']['tokens']} tokens" in printed and "expected on disk" in printed
    # the expected size printed up front is the payload; safetensors headers add well under 1 %
    assert summary["expected_bytes"] == m["data"]["tokens"] * 3 * 64 * 4
    assert 1.0 <= summary["disk_bytes"] / summary["expected_bytes"] < 1.01
    assert sum(s["tokens"] for s in m["shards"]) == m["data"]["tokens"]
    # the cached rows equal transformers' output_hidden_states of a plain single-row forward
    tgt = load_target({"name": str(tiny_target_dir), "dtype": "fp32"})
    data = prepare_data(_feature_cfg(tiny_target_dir, chat_file, tmp_path / "data-cache", out).data, tgt.tokenizer)
    cache = FeatureCache(out)
    ds = FeatureDataset(data.train, cache, [0, 2, L])
    for i in (0, 7, len(ds) - 1):
        row = ds[i]
        ids = torch.tensor([row["input_ids"]])
        ref = tgt.model(ids, output_hidden_states=True).hidden_states
        assert len(ref) == L + 1
        for l in (0, 2, L):
            assert row[f"hidden.{l}"].shape == (ids.shape[1], 64)
            torch.testing.assert_close(row[f"hidden.{l}"], ref[l][0], rtol=1e-4, atol=1e-5)
        assert not torch.allclose(row["hidden.2"], ref[3][0])  # a neighbouring layer is different


def test_offline_training_equals_online(tmp_path, tiny_target_dir, chat_file):
    """Same seed: the same loss curve from the target online and from the cache (fp32: exact; bf16: rounding)."""
    _train(tmp_path, tiny_target_dir, chat_file, "online")
    online = _losses(tmp_path / "online")
    for dtype, rel in (("fp32", 1e-5), ("bf16", 1e-3)):
        _capture(tmp_path, tiny_target_dir, chat_file, f"feat-{dtype}", f"dtype={dtype}")
        summary = _train(tmp_path, tiny_target_dir, chat_file, f"offline-{dtype}",
                         **{"features.dir": str(tmp_path / f"feat-{dtype}")})
        assert summary["features"].startswith("offline:")
        offline = _losses(tmp_path / f"offline-{dtype}")
        assert len(offline) == len(online) == 6
        for a, b in zip(online, offline):
            assert b == pytest.approx(a, rel=rel), (dtype, online, offline)
    assert online[-1] < online[0]


def test_lower_feature_layer_online_and_offline(tmp_path, tiny_target_dir, chat_file):
    """A draft on layer 2 needs layer 2 (input/regression) and L (the target's distribution) from either source."""
    _train(tmp_path, tiny_target_dir, chat_file, "online", **{"head.feature_layer": 2})
    _capture(tmp_path, tiny_target_dir, chat_file, "feat", "layers=[2,-1]", "dtype=fp32")
    _train(tmp_path, tiny_target_dir, chat_file, "offline", **{"head.feature_layer": 2,
                                                               "features.dir": str(tmp_path / "feat")})
    a, b = _losses(tmp_path / "online"), _losses(tmp_path / "offline")
    assert b == pytest.approx(a, rel=1e-5) and a[-1] < a[0]
    ckpt = json.loads((tmp_path / "online" / "final" / "config.json").read_text())
    assert ckpt["head_config"]["feature_layer"] == 2
    _capture(tmp_path, tiny_target_dir, chat_file, "top-only")
    with pytest.raises(ValueError, match=r"field layers is \[4\], this run needs \[2, 4\] \(missing \[2\]\)"):
        _train(tmp_path, tiny_target_dir, chat_file, "t", **{"head.feature_layer": 2,
                                                             "features.dir": str(tmp_path / "top-only")})


def test_mismatching_caches_are_refused(tmp_path, tiny_target_dir, tiny_qwen2_dir, chat_file):
    _capture(tmp_path, tiny_target_dir, chat_file, "l2", "layers=[2]")
    with pytest.raises(ValueError, match=r"field layers is \[2\], this run needs \[4\]"):
        _train(tmp_path, tiny_target_dir, chat_file, "t1", **{"features.dir": str(tmp_path / "l2")})
    _capture(tmp_path, tiny_target_dir, chat_file, "ok")
    # another target of the same shapes: the fingerprint differs
    with pytest.raises(ValueError, match=r"feature cache .*manifest.json was made for target .*fingerprint"):
        _train(tmp_path, tiny_qwen2_dir, chat_file, "t2", **{"features.dir": str(tmp_path / "ok"),
                                                             "data.cache_dir": str(tmp_path / "qwen-data")})
    # other tokenized data (a different max_length)
    with pytest.raises(ValueError, match="field data.key is"):
        _train(tmp_path, tiny_target_dir, chat_file, "t3", **{"features.dir": str(tmp_path / "ok"),
                                                              "data.max_length": 48})
    # rerunning the capture into the same directory with another plan
    with pytest.raises(ValueError, match=r"field layers is \[4\] there, this run has \[0, 4\]"):
        _capture(tmp_path, tiny_target_dir, chat_file, "ok", "layers=[0,-1]")
    # a shard cut short (a killed copy, a full disk)
    shard = tmp_path / "ok" / "shard-00001.safetensors"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(ValueError, match=rf"shard-00001.safetensors has {size - 100} bytes, .* expects {size}"):
        FeatureCache(tmp_path / "ok")


def test_killed_capture_job_resumes_where_it_stopped(tmp_path, tiny_target_dir, chat_file, monkeypatch):
    import draftheads.data_prep.features as feats

    real = feats.write_shard
    calls = []

    def dying(path, per_row, layers):
        if len(calls) == 2:  # killed while writing the third shard: only a temp file is left
            (path.parent / f".{path.name}.tmp-999").write_bytes(b"partial")
            raise KeyboardInterrupt
        calls.append(path.name)
        return real(path, per_row, layers)

    monkeypatch.setattr(feats, "write_shard", dying)
    with pytest.raises(KeyboardInterrupt):
        _capture(tmp_path, tiny_target_dir, chat_file, "feat")
    out = tmp_path / "feat"
    m = json.loads((out / "manifest.json").read_text())
    assert m["complete"] is False and [s["file"] for s in m["shards"]] == calls == [
        "shard-00000.safetensors", "shard-00001.safetensors"]
    with pytest.raises(ValueError, match=r"incomplete: 2 of 4 shards written"):
        FeatureCache(out)
    mtimes = {f: os.stat(out / f).st_mtime_ns for f in calls}
    monkeypatch.setattr(feats, "write_shard", real)
    summary, _ = _capture(tmp_path, tiny_target_dir, chat_file, "feat")
    assert summary["shards_written"] == 2 and summary["shards"] == 4  # only the missing ones
    assert {f: os.stat(out / f).st_mtime_ns for f in calls} == mtimes  # finished shards untouched
    assert not list(out.glob(".shard-*"))  # the partial temp file is gone
    _capture(tmp_path, tiny_target_dir, chat_file, "fresh")
    a, b = FeatureCache(out), FeatureCache(tmp_path / "fresh")
    assert len(a) == len(b)
    for i in range(len(a)):
        torch.testing.assert_close(a.row(i, [L])[L], b.row(i, [L])[L], rtol=0, atol=0)
