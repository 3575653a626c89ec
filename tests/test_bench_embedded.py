"""bench.embedded runs on the embedded pair (CPU), merges its results, and pools acceptance so
that τ = 1 + Σ accept_per_position."""

from __future__ import annotations

import json

import pytest

from bench.embedded import first_difference, load_prompts, main, pooled_acceptance
from dflash_serve.speculative.types import SpecStats

PROMPTS = [
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n",
]


def test_main_measures_the_embedded_pair_and_merges(embedded_pair, tmp_path):
    target_dir, drafter_dir = embedded_pair
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    out = tmp_path / "results" / "embedded.json"
    out.parent.mkdir()
    out.write_text(json.dumps({"speedup_gpu": 2.5, "unrelated": "kept", "corpus": "old"}))
    args = ["--target", str(target_dir), "--drafter", str(drafter_dir), "--prompts", str(prompts)]
    args += ["--device", "cpu", "--max-new-tokens", "16", "--num-prompts", "2", "--out", str(out)]
    returned = main([*args, "--corpus-note", "random weights", "--commit", "abc1234"])

    results = json.loads(out.read_text())
    assert results == returned
    for key in (
        "tau_greedy",
        "tau_t07",
        "accept_per_position",
        "identical_to_target_only",
        "first_difference",
        "speedup_cpu",
        "target_only_tok_s_cpu",
        "speculative_tok_s_cpu",
        "device_cpu",
        "date",
        "commit",
        "command",
        "num_prompts",
        "max_new_tokens",
        "torch",
        "corpus",
    ):
        assert key in results, key
    assert results["unrelated"] == "kept" and results["speedup_gpu"] == 2.5
    assert results["corpus"] == "random weights" and results["commit"] == "abc1234"
    assert results["num_prompts"] == 2 and results["max_new_tokens"] == 16
    assert results["identical_to_target_only"] is True and results["first_difference"] == {}
    assert 1.0 <= results["tau_greedy"] <= 16.0 and 1.0 <= results["tau_t07"] <= 16.0
    accepted = results["accept_per_position"]
    assert len(accepted) == 15 and all(0.0 <= a <= 1.0 for a in accepted)
    assert 1.0 + sum(accepted) == pytest.approx(results["tau_greedy"], abs=1e-12)
    assert results["speedup_cpu"] > 0 and results["target_only_tok_s_cpu"] > 0


def test_pooled_acceptance_is_one_plus_the_per_position_sum():
    first, second = SpecStats(), SpecStats()
    for num_drafted, num_accepted in ((15, 3), (15, 15), (15, 0)):
        first.record(num_drafted, num_accepted)
    second.record(4, 4)  # a short last block: positions 4.. were not drafted
    second.record(0, 0)  # the final target-only step does not count
    tau, per_position = pooled_acceptance([first, second], 15)
    assert tau == pytest.approx(1 + (3 + 15 + 0 + 4) / 4)
    assert per_position[:3] == [0.75] * 3
    assert per_position[3] == 0.5 and per_position[4:] == [0.25] * 11
    assert 1.0 + sum(per_position) == pytest.approx(tau)
    assert pooled_acceptance([SpecStats()], 15) == (1.0, [0.0] * 15)


def test_first_difference_and_prompt_validation(tmp_path):
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
    bad = tmp_path / "prompts.json"
    bad.write_text(json.dumps({"prompt": "not a list"}))
    with pytest.raises(ValueError, match="--prompts"):
        load_prompts(bad, tokenizer=None)
