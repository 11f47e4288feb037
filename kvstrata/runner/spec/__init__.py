"""Speculative decoding's worker half: the draft a runner builds for
--speculative-algorithm and the target's verification (the engine's half is
engine/sides/speculative.py; NGRAM needs no draft here, its drafts come from the engine).

  worker.py      SpecWorker: the one interface the model runner uses of any draft
  drafts.py      which draft the runner builds (STANDALONE, EAGLE/EAGLE3, NEXTN)
  standalone.py  STANDALONE: a second checkpoint drafting greedily (the base DraftModel)
  eagle.py       EAGLE / EAGLE3: a draft head over the target's hidden states
  mtp.py         NEXTN: a DeepSeek checkpoint's own MTP layer, run like an EAGLE head
  mtp_hybrid.py  NEXTN on Qwen3-Next and Qwen3.5: the MTP layer (full attention) beside the
                 recurrent target
  tree.py        draft trees (EAGLE-2 expansion, --speculative-eagle-topk > 1)
  verify.py      which drafts the target accepts (greedy and sampled, chain and tree)
  handoff.py     PD: the prefill's draft state that starts the decode's first round
"""
