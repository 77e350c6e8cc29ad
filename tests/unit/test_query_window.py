"""QueryWindows (kv/query_window.py): the last `window` queries per request and layer, written for all requests
of a step at once, against a per-request list kept by hand.

    .venv/bin/python -m pytest -q tests/unit/test_query_window.py
"""
import numpy as np
import torch

from megatron_sparse_rl.kv.query_window import QueryWindows


def test_windows_match_a_per_request_reference_across_steps_releases_and_growth():
    gen = torch.Generator().manual_seed(0)
    windows, window, heads, dim = QueryWindows(layers=2, window=3), 3, 2, 4
    reference: dict[tuple[int, str], list[torch.Tensor]] = {}
    steps = [  # (request ids, tokens each) per step: prefills of several tokens, decodes of one, requests leaving
        (["a", "b"], [5, 2]), (["a", "b"], [1, 1]), (["a", "c"], [1, 4]),
        *[([f"r{i}" for i in range(20)], [1] * 20)],  # more requests than the first buffer's 16 slots
        (["c", "a"], [1, 1]), (["d"], [2]),
    ]
    for n_step, (rids, counts) in enumerate(steps):
        if n_step == 4:
            for rid in [f"r{i}" for i in range(20)] + ["b"]:
                windows.release(rid)
                for layer in range(2):
                    reference.pop((layer, rid), None)
        qsl = np.concatenate([[0], np.cumsum(counts)])
        plan = windows.plan(rids, qsl)
        for layer in range(2):
            q = torch.randn(int(qsl[-1]), heads, dim, generator=gen)
            windows.write(layer, plan, q[plan.token])
            for row, rid in enumerate(rids):
                reference.setdefault((layer, rid), []).extend(q[int(qsl[row]):int(qsl[row + 1])])
        for (layer, rid), rows in reference.items():
            want = torch.stack(rows[-window:]).transpose(0, 1)  # [heads, n, dim], oldest first
            assert torch.equal(windows.get(layer, rid), want), (n_step, layer, rid)
    assert windows.get(0, "b") is None and windows.get(1, "never") is None
    # a released slot is reused and starts empty
    assert windows.slots["d"] in range(21)
