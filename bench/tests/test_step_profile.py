"""bench/step_profile.py's per-rank summary: collectives grouped by kind with counts and
times, the heaviest first (the profiling run itself is exercised by hand: it trains)."""

from bench.step_profile import summary


def test_summary_groups_events_by_kind_heaviest_first():
    rank = {"step_wall_s": 0.5, "events": {
        "gloo:all_reduce": [39, 0.098], "gloo:all_gather": [34, 0.048], "aten::mm": [342, 0.36],
        "_c10d_functional::wait_tensor": [73, 0.139], "aten::add": [10, 0.01]}}
    lines = summary([rank, rank])
    assert lines[0] == "rank 0: step 500 ms (profiled)"
    text = "\n".join(lines)
    assert "gloo work (collectives run): 73 events, 146 ms" in text
    assert text.index("gloo:all_reduce") < text.index("gloo:all_gather")  # heavier first
    assert "waits on functional collectives: 73 events, 139 ms" in text and "matmuls: 342 events" in text
    assert "aten::add" not in text and "rank 1:" in text
