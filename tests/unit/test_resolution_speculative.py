"""Speculative decoding flags: SGLang's names and defaults, the derived draft shape with a
recorded reason each, and the unbuilt combinations refused by name."""
from __future__ import annotations

import pytest

from kvstrata.config import ServerArgs, refuse_unimplemented, unimplemented_flags
from kvstrata.config.resolve import resolve
from kvstrata.config.rules.speculative import TREE_DRAFTS_REASON


def resolved(**kw):
    args, res = resolve(ServerArgs(**kw), "cpu")
    return args, {r.rule: r for r in res if r.rule.startswith("spec.")}


def test_off_by_default_changes_nothing():
    args, rules = resolved()
    assert args.speculative_algorithm is None and rules == {}
    assert args.speculative_num_draft_tokens is None


def test_ngram_defaults_follow_sglang_with_a_chain():
    args, rules = resolved(speculative_algorithm="NGRAM")
    assert args.speculative_num_draft_tokens == 12  # = max match window (SGLang)
    assert args.speculative_ngram_max_bfs_breadth == 1
    assert TREE_DRAFTS_REASON in rules["spec.ngram_breadth"].reason
    assert args.speculative_eagle_topk == 1 and args.speculative_num_steps == 11
    assert unimplemented_flags(args) == []
    refuse_unimplemented(ServerArgs(speculative_algorithm="NGRAM"))


def test_ngram_draft_tokens_follow_the_window_and_explicit_values_win():
    args, _ = resolved(speculative_algorithm="NGRAM",
                       speculative_ngram_max_match_window_size=5)
    assert args.speculative_num_draft_tokens == 5
    args, rules = resolved(speculative_algorithm="NGRAM", speculative_num_draft_tokens=7)
    assert args.speculative_num_draft_tokens == 7 and "spec.ngram_tokens" not in rules


def test_chain_forces_draft_tokens_to_steps_plus_one():
    args, rules = resolved(speculative_algorithm="NGRAM", speculative_num_steps=3,
                           speculative_num_draft_tokens=9)
    assert args.speculative_num_draft_tokens == 4
    assert "num_steps + 1 = 4" in rules["spec.chain"].reason


def test_nextn_becomes_eagle_with_its_own_mtp_layer_and_the_auto_shape():
    args, rules = resolved(speculative_algorithm="NEXTN")
    assert args.speculative_algorithm == "EAGLE"
    assert "MTP layer" in rules["spec.nextn"].reason
    assert args.speculative_draft_model_path == args.model_path
    assert "own checkpoint" in rules["spec.nextn_draft"].reason
    assert (args.speculative_num_steps, args.speculative_eagle_topk,
            args.speculative_num_draft_tokens) == (3, 1, 4)
    assert "NEXTN" in rules["spec.auto_shape"].reason
    assert unimplemented_flags(ServerArgs(speculative_algorithm="NEXTN")) == []
    args, rules = resolved(speculative_algorithm="NEXTN", speculative_draft_model_path="/mtp")
    assert args.speculative_draft_model_path == "/mtp" and "spec.nextn_draft" not in rules
    assert unimplemented_flags(ServerArgs(speculative_algorithm="NEXTN",
                                          speculative_token_map="/m.pt")) == [
        "--speculative-token-map with NEXTN (FR-Spec is built for EAGLE heads)"]


def test_nextn_under_tp_is_refused_at_resolution_for_models_without_recurrent_state():
    """NEXTN at --tp-size > 1 passes the model-blind check (Qwen3-Next and Qwen3.5 split
    their MTP layer per rank: tests/unit/test_resolution_recurrent.py); on any other model,
    or with none known, the resolution refuses it by name."""
    from kvstrata.config.resolve_types import ModelInfo

    args = ServerArgs(speculative_algorithm="NEXTN", tp_size=2)
    assert unimplemented_flags(args) == []
    with pytest.raises(ValueError, match="NEXTN with --tp-size 2 on this model: the MTP layer "
                                         "is split across ranks for Qwen3-Next and Qwen3.5"):
        resolve(args, "cpu")
    v3 = ModelInfo.from_hf_config({"model_type": "deepseek_v3", "num_hidden_layers": 2,
                                   "architectures": ["DeepseekV3ForCausalLM"]})
    with pytest.raises(ValueError, match="on DeepseekV3ForCausalLM: the MTP layer is split"):
        resolve(args, "cpu", v3)


@pytest.mark.parametrize("kwargs,named", [
    ({"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": "/d",
      "speculative_draft_model_quantization": "w8a8_int8"},
     "--speculative-draft-model-quantization w8a8_int8 with EAGLE3 (the head is one layer; "
     "it runs in the target's dtype)"),    ({"speculative_algorithm": "EAGLE", "speculative_draft_model_path": "/d",
      "speculative_draft_model_quantization": "w8a8_int8"},
     "--speculative-draft-model-quantization w8a8_int8 with EAGLE (the head is one layer; "
     "it runs in the target's dtype)"),
    ({"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "/d",
      "speculative_draft_model_quantization": "bitsandbytes"},
     "--speculative-draft-model-quantization bitsandbytes"),
])
def test_unbuilt_speculation_is_refused_by_name(kwargs, named):
    args = ServerArgs(**kwargs)
    assert unimplemented_flags(args) == [named]
    with pytest.raises(NotImplementedError, match="not implemented yet"):
        refuse_unimplemented(args)


@pytest.mark.parametrize("kwargs,message", [
    ({"speculative_num_draft_tokens": 1}, "--speculative-num-draft-tokens must be >= 2"),
    ({"speculative_ngram_branch_length": 0}, "--speculative-ngram-branch-length must be >= 1"),
    ({"speculative_algorithm": "MEDUSA"}, "--speculative-algorithm must be one of"),
])
def test_bad_values_name_the_flag(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(**kwargs)


def test_inconsistent_ngram_windows_are_refused():
    with pytest.raises(ValueError, match="--speculative-ngram-min-match-window-size 5 must be "
                                         "<= --speculative-ngram-max-match-window-size 3"):
        resolve(ServerArgs(speculative_algorithm="NGRAM",
                           speculative_ngram_min_match_window_size=5,
                           speculative_ngram_max_match_window_size=3), "cpu")


@pytest.mark.parametrize("kwargs,message", [
    ({"speculative_num_draft_tokens": 5},
     "--speculative-num-draft-tokens needs --speculative-algorithm"),
    ({"speculative_ngram_capacity": 100, "speculative_eagle_topk": 1},
     "--speculative-eagle-topk, --speculative-ngram-capacity needs --speculative-algorithm"),
    ({"speculative_algorithm": "NGRAM", "speculative_draft_model_path": "/m"},
     "--speculative-draft-model-path: NGRAM has no draft model"),
    ({"speculative_algorithm": "STANDALONE"},
     "--speculative-algorithm STANDALONE needs --speculative-draft-model-path"),
    ({"speculative_algorithm": "EAGLE"},
     "--speculative-algorithm EAGLE needs --speculative-draft-model-path \\(the EAGLE head"),
])
def test_flags_that_would_be_ignored_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        resolve(ServerArgs(**kwargs), "cpu")


def test_standalone_gets_sglangs_auto_shape_and_is_built():
    args, rules = resolved(speculative_algorithm="STANDALONE",
                           speculative_draft_model_path="/d",
                           speculative_draft_model_quantization="w8a8_int8")
    assert (args.speculative_num_steps, args.speculative_eagle_topk,
            args.speculative_num_draft_tokens) == (3, 1, 4)
    assert "STANDALONE auto draft shape" in rules["spec.auto_shape"].reason
    assert unimplemented_flags(args) == []
    args, rules = resolved(speculative_algorithm="STANDALONE",
                           speculative_draft_model_path="/d", speculative_num_steps=5)
    assert args.speculative_num_draft_tokens == 6  # a chain: steps + 1


def test_eagle_gets_the_auto_shape_and_is_built():
    args, rules = resolved(speculative_algorithm="EAGLE", speculative_draft_model_path="/d")
    assert (args.speculative_num_steps, args.speculative_eagle_topk,
            args.speculative_num_draft_tokens) == (3, 1, 4)
    assert "EAGLE auto draft shape" in rules["spec.auto_shape"].reason
    assert unimplemented_flags(args) == []


@pytest.mark.parametrize("kwargs", [{"speculative_ngram_max_bfs_breadth": 10},
                                    {"speculative_ngram_match_type": "PROB"},
                                    {"speculative_ngram_max_bfs_breadth": 4,
                                     "speculative_ngram_min_bfs_breadth": 2}])
def test_ngram_trees_are_built(kwargs):
    args, rules = resolved(speculative_algorithm="NGRAM", **kwargs)
    assert unimplemented_flags(args) == []
    assert args.speculative_eagle_topk == args.speculative_ngram_max_bfs_breadth


def test_draft_model_trees_are_built_and_need_enough_candidates():
    args, _ = resolved(speculative_algorithm="EAGLE", speculative_draft_model_path="/d",
                       speculative_eagle_topk=4, speculative_num_steps=3,
                       speculative_num_draft_tokens=16)
    assert unimplemented_flags(args) == [] and args.speculative_num_draft_tokens == 16
    with pytest.raises(ValueError, match="--speculative-num-draft-tokens 8: a tree of topk 2 "
                                         "over 1 steps has only 2 candidates"):
        resolved(speculative_algorithm="STANDALONE", speculative_draft_model_path="/d",
                 speculative_eagle_topk=2, speculative_num_steps=1,
                 speculative_num_draft_tokens=8)


def test_lossy_accept_thresholds_are_built():
    args, _ = resolved(speculative_algorithm="NGRAM", speculative_accept_threshold_single=0.5,
                       speculative_accept_threshold_acc=0.7)
    assert unimplemented_flags(args) == []
    with pytest.raises(ValueError, match="--speculative-accept-threshold-acc"):
        ServerArgs(speculative_algorithm="NGRAM", speculative_accept_threshold_acc=1.5)


def test_a_token_map_is_for_eagle_heads():
    args, _ = resolved(speculative_algorithm="EAGLE", speculative_draft_model_path="/d",
                       speculative_token_map="/m.pt")
    assert unimplemented_flags(args) == []
    assert unimplemented_flags(ServerArgs(speculative_algorithm="NGRAM",
                                          speculative_token_map="/m.pt")) == [
        "--speculative-token-map with NGRAM (FR-Spec is built for EAGLE heads)"]


def test_eagle3_is_built_and_needs_its_head():
    args, _ = resolved(speculative_algorithm="EAGLE3", speculative_draft_model_path="/d")
    assert unimplemented_flags(args) == [] and args.speculative_num_draft_tokens == 4
    with pytest.raises(ValueError, match="EAGLE3 needs --speculative-draft-model-path"):
        resolved(speculative_algorithm="EAGLE3")
