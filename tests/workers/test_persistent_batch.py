"""The persistent batch's draft tokens: written after a row's known tokens, refused with the
request's id when they would not fit, whether they come in the plan or from the draft model."""

from __future__ import annotations

import numpy as np
import pytest

from tidal.ipc.messages import SamplingParams, pack_token_ids
from tidal.ipc.worker_messages import CachedRequestData, NewRequestData
from tidal.workers.persistent_batch import PersistentBatch

MAX_MODEL_LEN = 8
VOCAB = 100


def batch_holding(*req_ids: str, prompt: tuple[int, ...] = (1, 2, 3, 4, 5)
                  ) -> PersistentBatch:
    batch = PersistentBatch(max_num_reqs=4, max_model_len=MAX_MODEL_LEN, max_blocks_per_req=2,
                            vocab_size=VOCAB)
    for req_id in req_ids:
        batch.add(NewRequestData(req_id, pack_token_ids(list(prompt)), len(prompt), [1], 0,
                                 len(prompt), SamplingParams(temperature=0.0)))
    return batch


def test_drafts_follow_the_known_tokens_without_counting_as_known():
    batch = batch_holding("a", "b")
    row = batch.req_id_to_row["b"]
    batch.set_drafts(row, np.array([7, 8], np.int32))
    assert batch.token_ids[row, 5:7].tolist() == [7, 8]
    assert batch.num_spec[row] == 2 and batch.num_tokens[row] == 5


def test_drafts_in_the_plan_past_max_model_len_name_the_request():
    batch = batch_holding("a", "b")
    delta = CachedRequestData("b", [], 5, 5, spec_token_ids=pack_token_ids([7, 8, 9, 10]))
    with pytest.raises(ValueError, match="request 'b': 4 draft tokens after 5 would pass"):
        batch.update(delta)


def test_draft_model_drafts_outside_the_vocabulary_name_the_request():
    batch = batch_holding("a", "b")
    with pytest.raises(ValueError, match="request 'b': draft token ids outside"):
        batch.set_drafts(batch.req_id_to_row["b"], np.array([VOCAB], np.int32))
