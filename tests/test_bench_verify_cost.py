"""scripts/bench_verify_cost.py: the body / lm_head split of a verification forward, on a tiny target."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from draftheads.heads.target import from_model
from draftheads.scripts.bench_verify_cost import verify_cost


def test_verify_cost_splits_body_and_lm_head_and_leaves_the_cache_at_the_context():
    tgt = from_model(tiny_model("llama", vocab_size=4096))
    seen: list[int] = []
    tgt.lm_head().register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[0]))
    res = verify_cost(tgt, context=12, widths=[1, 4, 8], repeats=2)
    assert res["vocab_size"] == 4096 and [r["width"] for r in res["rows"]] == [1, 4, 8]
    for r in res["rows"]:
        assert r["body_ms"] > 0 and r["lm_head_one_row_ms"] > 0
        assert r["forward_ms"] == pytest.approx(r["body_ms"] + r["lm_head_all_rows_ms"], abs=2e-3)  # each rounded
    assert res["rows"][0]["x_t1"] == 1.0 and 0 < res["lm_head_share_t1"] < 1
    assert set(seen) == {1, 4, 8}  # all rows of each width, and one row
    # the body was timed on top of exactly ``context`` cached tokens each time: a forward now lands at position 12
    cache = tgt.new_cache()
    ids = torch.arange(3, 20)[None]  # [1, 17]
    ref = tgt(ids, cache=cache)["logits"][0, 12:]  # [5, V]
    cache2 = tgt.new_cache()
    tgt(ids[:, :12], cache=cache2, logits=False)
    from draftheads.eval.generate import crop_cache

    tgt(ids[:, 12:16], cache=cache2, logits=False)
    crop_cache(cache2, 12)
    got = tgt(ids[:, 12:], cache=cache2, position_ids=torch.arange(12, 17)[None])["logits"][0]
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
