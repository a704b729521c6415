"""A constrained request waits for its grammar off the step path: the engine core sends the
grammar to the workers once, keeps the request out of the queues until a result lists it as
compiled, and meanwhile the batch goes on (issue 39: a slow compile stalled every stream)."""

from __future__ import annotations

from tidal.engine_core.request import RequestStatus
from tidal.engine_core.core import has_work
from tidal.ipc.messages import StructuredOutputsParams

from sched_utils import FakeWorker, make_request, make_scheduler, output_tokens, step

JSON = StructuredOutputsParams(json={"type": "object"})


def constrained(req_id: str, **kwargs):
    return make_request(req_id, 8, eos=0, max_tokens=4, structured_outputs=JSON, **kwargs)


def test_the_batch_goes_on_while_a_grammar_compiles():
    sched, worker = make_scheduler(), FakeWorker(16)
    sched.add(make_request("plain", 8, max_tokens=6))
    sched.add(constrained("json"))
    worker.hold_grammars.add("json")
    plan, _ = step(sched, worker)
    assert [g.req_id for g in plan.grammars] == ["json"]
    assert [n.req_id for n in plan.new_requests] == ["plain"]
    assert plan.awaits_grammars
    assert sched.requests["json"].status == RequestStatus.WAITING_FOR_GRAMMAR
    for _ in range(3):  # the plain request decodes; the grammar is sent only once
        plan, outputs = step(sched, worker)
        assert plan.grammars == [] and "json" not in {c.req_id for c in plan.cached_requests}
        assert len(output_tokens(outputs, "plain")) == 1
    assert sched.stats().num_waiting == 1
    worker.hold_grammars.clear()
    step(sched, worker)  # its compile ends: the result says so
    plan, _ = step(sched, worker)
    assert [n.req_id for n in plan.new_requests] == ["json"]
    assert not plan.awaits_grammars


def test_a_plan_is_sent_to_poll_while_only_grammars_are_left():
    sched, worker = make_scheduler(), FakeWorker(16)
    sched.add(constrained("json"))
    worker.hold_grammars.add("json")
    for _ in range(2):
        plan, _ = step(sched, worker)
        assert plan.total_num_scheduled_tokens == 0 and has_work(plan)
    worker.hold_grammars.clear()
    step(sched, worker)
    plan, _ = step(sched, worker)
    assert [n.req_id for n in plan.new_requests] == ["json"]


def test_a_grammar_that_does_not_compile_fails_its_request_alone():
    sched, worker = make_scheduler(), FakeWorker(16)
    sched.add(constrained("bad"))
    sched.add(constrained("good"))
    worker.bad_grammars.add("bad")
    _, outputs = step(sched, worker)
    (failure,) = [o for outs in outputs.values() for o in outs if o.req_id == "bad"]
    assert failure.refused and "does not compile" in failure.error
    assert "bad" not in sched.requests
    plan, _ = step(sched, worker)  # the workers are told to forget its compile
    assert "bad" in plan.finished_req_ids
    assert [n.req_id for n in plan.new_requests] == ["good"]


def test_an_aborted_request_that_awaits_its_grammar_is_forgotten_by_the_workers():
    sched, worker = make_scheduler(), FakeWorker(16)
    sched.add(constrained("json"))
    worker.hold_grammars.add("json")
    step(sched, worker)
    sched.abort(["json"])
    plan, _ = step(sched, worker)
    assert plan.finished_req_ids == ["json"] and not plan.awaits_grammars
    assert worker.grammars == {} and not sched.has_unfinished_requests()


def test_new_workers_are_sent_every_grammar_again():
    sched, worker = make_scheduler(), FakeWorker(16)
    sched.add(constrained("running"))
    sched.add(constrained("compiling"))
    worker.hold_grammars.add("compiling")
    step(sched, worker)
    step(sched, worker)
    assert sched.requests["running"].status == RequestStatus.RUNNING
    sched.recompute_all()  # the workers were replaced
    sched.check_invariants()
    worker = FakeWorker(16)
    plan, _ = step(sched, worker)
    assert sorted(g.req_id for g in plan.grammars) == ["compiling", "running"]
    assert plan.new_requests == []
    done = set()
    for _ in range(12):
        _, outputs = step(sched, worker)
        done |= {o.req_id for outs in outputs.values() for o in outs if o.finish_reason}
    assert done == {"running", "compiling"}
