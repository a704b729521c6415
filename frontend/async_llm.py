"""`AsyncLLM`: the asyncio frontend (streaming, abort, stats), on uvloop.

    llm = await AsyncLLM.create(config)            # starts a private engine-core daemon
    llm = await AsyncLLM.create(engine=ADDRESS)    # attaches to a running one
    async for out in llm.generate("Hello", SamplingParams(max_tokens=32)):
        print(out.outputs[0].delta_text, end="")
    await llm.close()

One background task reads the socket and routes outputs, through the `OutputProcessor`
(detokenize, stop strings, n > 1, stream interval), into one `RequestOutputCollector` per
request. A collector holds at most one pending update: if the consumer falls behind, newer
deltas are merged into it (vLLM's back-pressure without unbounded queues). A request the engine
core refuses (bad input) makes `generate` raise ValueError naming the field.

No request is left without an end, and a lost engine core does not end them. When the core
goes away (an `EngineDead` message, a lost connection) or drops this frontend (`Detached`: it
was silent past the core's --frontend-timeout, or a new core sits at the address), pending
requests are suspended and their old engine ids aborted (a no-op in a core that forgot them).
New calls raise `EngineUnavailable` (a RuntimeError) meanwhile. Then:
- a core answers the Hello this frontend sends on every new connection, serving the same
  model: attached again, and every unfinished completion is resubmitted under a new engine
  id with its prompt plus the tokens already delivered, max_tokens / min_tokens reduced, the
  same seed and stops (OutputProcessor.resubmit_all), so its stream goes on where it stopped;
- our private daemon died, or went silent (no heartbeat echoed for its --frontend-timeout:
  stopped or hung, so it is killed first): it is started again at the same address (at most
  `max_engine_restarts` times within 10 minutes, a warning each), and the same re-attach
  follows;
- no core within `engine_restart_timeout` seconds: the suspended requests end with
  finish_reason "error" and the reason (at once when the timeout is 0). A private daemon
  that died once more than it may be restarted makes the frontend dead for good (`dead`);
  later calls raise RuntimeError.
Messages the core sent in answer to frames that left before our new Hello (a `Detached` for
each, say) arrive before its `EngineInfo` (one ordered pipe), so they are ignored while away.

Run it on uvloop: `tidal.frontend.async_llm.run(main())` (or `uvloop.run`); uvicorn picks
uvloop by itself.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import uuid
from collections.abc import AsyncIterator

from ..engine_core.config import EngineConfig
from ..engine_core.launcher import DaemonProcess
from ..engine_core.model_files import prepare_model
from ..engine_core.supervisor import Supervisor
from .engine_client import (
    AsyncEngineClient,
    encode_prompt,
    load_tokenizer,
    read_eos_token_ids,
)
from .output_processor import OutputProcessor
from .outputs import CompletionOutput, EmbeddingRequestOutput, RequestOutput
from .structured_output import GrammarChecker
from ..ipc.frontend_messages import (
    Abort,
    Detached,
    EngineDead,
    EngineInfo,
    EngineOutputs,
    SchedulerStats,
    StatsQuery,
)
from ..ipc.lora import read_adapter_config
from ..ipc.messages import LoRARequest, SamplingParams, check_priority, is_valid_unicode
from ..ipc.pooling import PoolingParams
from ..ipc.transport import new_private_address

logger = logging.getLogger(__name__)

_OUTPUT_CHUNK = 128  # outputs processed between two yields to the event loop (vLLM's default)
_STATS_TIMEOUT_S = 10.0
_DAEMON_POLL_S = 0.5
DEFAULT_ENGINE_RESTART_TIMEOUT_S = 60.0
DEFAULT_MAX_ENGINE_RESTARTS = 3


class EngineUnavailable(RuntimeError):
    """No engine core is attached right now (it went away or dropped us); this frontend
    re-attaches by itself when one answers at the same address. Retry later."""


def run(main):
    """Run coroutine `main` on a fresh uvloop event loop (like `asyncio.run`)."""
    import uvloop

    return uvloop.run(main)


async def _in_own_thread(fn):
    """Run blocking `fn` in a new thread and await it. Unlike asyncio.to_thread this also
    works at interpreter exit, after the default executor has been shut down."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def target():
        try:
            result = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            loop.call_soon_threadsafe(_settle_future, fut, None, e)
        else:
            loop.call_soon_threadsafe(_settle_future, fut, result, None)

    threading.Thread(target=target, name="tidal-blocking", daemon=True).start()
    return await fut


def _settle_future(fut: asyncio.Future, result, error) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


class RequestOutputCollector:
    """The hand-off point between the output task and one `generate()` consumer."""

    def __init__(self) -> None:
        self._pending: RequestOutput | None = None
        self._error: Exception | None = None
        self._ready = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        """Deliver an update; merged into the pending one if the consumer has not taken it."""
        self._pending = output if self._pending is None else merge_outputs(self._pending, output)
        self._ready.set()

    def fail(self, error: Exception) -> None:
        """End the request with `error`, raised by the next `get()`."""
        self._error = error
        self._ready.set()

    async def get(self) -> RequestOutput:
        """The next (possibly merged) update; raises the error given to `fail()`."""
        while self._pending is None and self._error is None:
            self._ready.clear()
            await self._ready.wait()
        if self._error is not None:
            raise self._error
        output, self._pending = self._pending, None
        return output


def merge_outputs(old: RequestOutput, new: RequestOutput) -> RequestOutput:
    """One update equal to `old` followed by `new` (cumulative fields from new, deltas joined)."""
    by_index = {c.index: c for c in old.outputs}
    for comp in new.outputs:
        prev = by_index.get(comp.index)
        by_index[comp.index] = comp if prev is None else _merge_completion(prev, comp)
    outputs = [by_index[i] for i in sorted(by_index)]
    return RequestOutput(new.request_id, new.prompt, new.prompt_token_ids, outputs,
                         new.finished, new.metrics, new.prompt_logprobs or old.prompt_logprobs)


def _merge_completion(prev: CompletionOutput, comp: CompletionOutput) -> CompletionOutput:
    delta_logprobs = comp.delta_logprobs
    if prev.delta_logprobs is not None and comp.delta_logprobs is not None:
        delta_logprobs = prev.delta_logprobs + comp.delta_logprobs
    return CompletionOutput(
        index=comp.index, text=comp.text, token_ids=comp.token_ids,
        delta_text=prev.delta_text + comp.delta_text,
        delta_token_ids=prev.delta_token_ids + comp.delta_token_ids,
        logprobs=comp.logprobs, delta_logprobs=delta_logprobs,
        cumulative_logprob=comp.cumulative_logprob, finish_reason=comp.finish_reason,
        stop_reason=comp.stop_reason, error=comp.error)


class AsyncLLM:
    """An asyncio frontend attached to one engine-core daemon (see the module docstring)."""

    engine_info: EngineInfo
    """What the daemon said about itself at attach time (max_model_len, stream_interval...)."""
    tokenizer: object
    """The model's fast Hugging Face tokenizer."""
    model_name: str
    """The served model name."""

    def __init__(self, client: AsyncEngineClient, info: EngineInfo, tokenizer,
                 eos_token_ids: list[int], supervisor: Supervisor[DaemonProcess] | None, *,
                 engine_restart_timeout: float = DEFAULT_ENGINE_RESTART_TIMEOUT_S):
        """Use `AsyncLLM.create`; this wires already-started parts together (`supervisor`:
        of the private daemon, None when attached to someone else's)."""
        self._client = client
        self.client_id = client.client_id
        self.engine_info = info
        self.tokenizer = tokenizer
        self.model_name = info.served_model_name or info.model
        self.supervisor = supervisor
        self._processor = OutputProcessor(tokenizer, eos_token_ids[0] if eos_token_ids else None,
                                          eos_token_ids[1:])
        self._grammars = GrammarChecker(tokenizer, info,
                                        eos_token_ids[0] if eos_token_ids else None)
        self._collectors: dict[str, RequestOutputCollector] = {}  # request_id -> collector
        self._stats_waiters: list[asyncio.Future] = []
        self.latest_stats: SchedulerStats | None = None
        self.num_generated_tokens = 0  # tokens received from the engine, all requests
        self.dead = False
        self.dead_reason: str | None = None
        self.away_reason: str | None = None  # why no core is attached now
        self.engine_restart_timeout = engine_restart_timeout
        self.num_resubmitted = 0  # engine requests sent again to a new core, all told
        self._give_up: asyncio.TimerHandle | None = None  # ends suspended requests
        self._closed = False
        self._tasks = [asyncio.ensure_future(self._output_loop())]
        if supervisor is not None:
            self._tasks.append(asyncio.ensure_future(self._watch_daemon()))

    # -- construction ---------------------------------------------------------------------

    @classmethod
    async def create(cls, config: EngineConfig | None = None, *, engine: str | None = None,
                     key_file: str | None = None, client_kind: str = "python",
                     tokenizer: str | None = None, startup_timeout: float = 300.0,
                     echo_daemon_output: bool = True,
                     engine_restart_timeout: float = DEFAULT_ENGINE_RESTART_TIMEOUT_S,
                     max_engine_restarts: int = DEFAULT_MAX_ENGINE_RESTARTS,
                     frontend_timeout: float | None = None) -> "AsyncLLM":
        """Start a private daemon for `config`, or attach to the daemon at `engine`.

        Exactly one of `config` and `engine`. `tokenizer` overrides the tokenizer folder
        (default: the config's, or the one the daemon names). RuntimeError, quoting the
        daemon's last output, if it does not become ready within `startup_timeout` seconds.
        `engine_restart_timeout`: how long requests wait, suspended, for a lost core to come
        back (0: they fail at once); `max_engine_restarts`: how often a private daemon that
        died is started again (0: never). `frontend_timeout`: a private daemon's
        `--frontend-timeout` (None: its default): how long either side's silence is borne
        before the daemon drops this frontend, or this frontend kills the stopped or hung
        daemon and starts it again.
        """
        if engine_restart_timeout < 0:
            raise ValueError(f"engine_restart_timeout must be >= 0, got {engine_restart_timeout}")
        if max_engine_restarts < 0:
            raise ValueError(f"max_engine_restarts must be >= 0, got {max_engine_restarts}")
        if (config is None) == (engine is None):
            raise ValueError("give exactly one of config (start a daemon) or engine (attach)")
        if frontend_timeout is not None and (engine is not None or frontend_timeout <= 0):
            raise ValueError("frontend_timeout: a positive number of seconds, for a private "
                             f"daemon only (the attached core has its own); got {frontend_timeout}")
        supervisor = None
        if config is not None:
            # a Hub id is fetched now (once, before the daemon), and what can be checked
            # without torch is, so a bad model is one ValueError, not a failed start-up
            config = await asyncio.to_thread(prepare_model, config)
            extra = [] if frontend_timeout is None else ["--frontend-timeout",
                                                         str(frontend_timeout)]
            engine = new_private_address()
            supervisor = Supervisor(
                "the engine core", functools.partial(
                    DaemonProcess, config, address=engine, echo=echo_daemon_output,
                    extra_args=extra),
                max_engine_restarts, flag="max_engine_restarts",
                how="starting it again at the same address")
            supervisor.start()
            tokenizer = tokenizer or config.model.tokenizer_path
        try:
            return await cls._attach(
                engine, key_file, client_kind, tokenizer, supervisor, startup_timeout,
                engine_restart_timeout=engine_restart_timeout)
        except BaseException:
            if supervisor is not None:
                await _in_own_thread(supervisor.stop)
            raise

    @classmethod
    async def _attach(cls, address: str, key_file: str | None, kind: str,
                      tokenizer_path: str | None, supervisor: Supervisor[DaemonProcess] | None,
                      timeout: float, **restart) -> "AsyncLLM":
        client = AsyncEngineClient(address, key_file, kind)
        client.start()
        # load the tokenizer while the daemon starts (its path is known up front when we own it)
        tok_task = asyncio.ensure_future(asyncio.to_thread(load_tokenizer, tokenizer_path)) \
            if tokenizer_path else None
        daemon = supervisor.child if supervisor is not None else None
        try:
            info = await client.wait_for_info(timeout, daemon.alive if daemon else None)
        except RuntimeError as e:
            await client.close()
            if tok_task is not None:
                tok_task.cancel()
            if daemon is None:
                raise
            await _in_own_thread(lambda: daemon.wait(2.0))  # it is exiting: take its last words
            raise RuntimeError(daemon.failure_message(str(e))) from None
        if tok_task is None:
            tok_task = asyncio.to_thread(load_tokenizer, info.tokenizer or info.model)
        try:
            tok = await tok_task
        except BaseException:
            await client.close()
            raise
        eos_ids = read_eos_token_ids(info.model, tok)  # generation_config.json of the model
        return cls(client, info, tok, eos_ids, supervisor, **restart)

    # -- requests -------------------------------------------------------------------------

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        """Token ids of `prompt`; ValueError if empty or too long (both numbers given)."""
        return encode_prompt(self.tokenizer, prompt, self.engine_info.max_model_len,
                             self.engine_info.vocab_size)

    def encode_embedding_prompt(self, prompt: str | list[int]) -> list[int]:
        """Token ids of an embedding prompt; ValueError if empty or over max_model_len (it
        generates nothing, so it may fill the context)."""
        return encode_prompt(self.tokenizer, prompt, self.engine_info.max_model_len,
                             self.engine_info.vocab_size, pooling=True)

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str | None = None, *, priority: int = 0,
                       stream_interval: int | None = None,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """Stream updates of one request: the first token at once, then every
        `stream_interval` tokens (the engine's when None; a request may only raise it), the
        rest when it finishes. Leaving the loop early (break, cancellation, an HTTP client
        gone) aborts the request in the engine. ValueError naming the field when the prompt
        or the engine core refuses the request."""
        interval = max(self.engine_info.stream_interval, stream_interval or 1)
        prompt_ids = await self._encode_off_loop(prompt)
        await self.check_structured_outputs(params)
        request_id, collector = self._add_request(prompt, params, request_id, priority,
                                                  interval, final_only=False,
                                                  prompt_ids=prompt_ids,
                                                  lora_request=lora_request)
        finished = False
        try:
            while not finished:
                output = await collector.get()
                finished = output.finished
                yield output
        finally:
            self._collectors.pop(request_id, None)
            if not finished:
                self._abort_quietly(request_id)

    async def generate_final(self, prompt: str | list[int], params: SamplingParams,
                             request_id: str | None = None, *, priority: int = 0,
                             prompt_token_ids: list[int] | None = None,
                             lora_request: LoRARequest | None = None) -> RequestOutput:
        """The finished result of one request (all n completions), without streaming.

        `prompt_token_ids`: the prompt already encoded by `encode_prompt` (not re-checked).
        ValueError naming the field when the engine core refuses the request.
        """
        if prompt_token_ids is None:
            prompt_token_ids = await self._encode_off_loop(prompt)
        await self.check_structured_outputs(params)
        request_id, collector = self._add_request(prompt, params, request_id, priority, 1,
                                                  final_only=True, prompt_ids=prompt_token_ids,
                                                  lora_request=lora_request)
        return await self._final_output(request_id, collector)

    async def embed(self, prompt: str | list[int], pooling_params: PoolingParams | None = None,
                    request_id: str | None = None, *,
                    prompt_token_ids: list[int] | None = None) -> EmbeddingRequestOutput:
        """One prompt's vector, from an engine started with --runner pooling (a prefill
        only, batched with everything else: docs/embeddings.md). `pooling_params`' unset
        fields take the engine's (`EngineInfo.pooler`). ValueError naming the field for a
        bad prompt (more than max_model_len tokens), `dimensions` the model does not allow,
        or an engine that only generates; the output's finish_reason says "error" (and
        `error` why) when the engine failed it."""
        pooler = self.engine_info.pooler
        if pooler is None:
            raise ValueError("pooling: this engine generates text; embeddings need one "
                             "started with --runner pooling")
        params = pooler.resolve(pooling_params)
        if prompt_token_ids is None:
            self._check_usable()
            prompt_token_ids = (await asyncio.to_thread(self.encode_embedding_prompt, prompt)
                                if isinstance(prompt, str)
                                else self.encode_embedding_prompt(prompt))
        request_id, collector = self._add_request(
            prompt, SamplingParams(max_tokens=1, temperature=0.0), request_id, 0, 1,
            final_only=True, prompt_ids=prompt_token_ids, pooling=params)
        return await self._final_output(request_id, collector)

    async def _final_output(self, request_id: str, collector):
        """The one output a final-only request's collector gets; the request is aborted if
        the wait ends without it (the caller cancelled)."""
        try:
            return await collector.get()
        finally:
            self._collectors.pop(request_id, None)
            if self._processor.has_request(request_id):
                self._abort_quietly(request_id)

    async def check_structured_outputs(self, params: SamplingParams) -> None:
        """ValueError naming the field when `params.structured_outputs` does not compile
        (compiled in a thread: a large schema must not stall the event loop)."""
        if isinstance(params, SamplingParams) and params.structured_outputs is not None:
            await asyncio.to_thread(self._grammars.check, params)

    async def _encode_off_loop(self, prompt: str | list[int]) -> list[int]:
        """`encode_prompt`; text is tokenized in a thread, so that a huge prompt does not stall
        the event loop (other requests' streams, the heartbeat)."""
        self._check_usable()
        if isinstance(prompt, str):
            return await asyncio.to_thread(self.encode_prompt, prompt)
        return self.encode_prompt(prompt)

    def _add_request(self, prompt, params: SamplingParams, request_id: str | None,
                     priority: int, interval: int, final_only: bool,
                     prompt_ids: list[int] | None = None,
                     lora_request: LoRARequest | None = None,
                     pooling: PoolingParams | None = None):
        if (pooling is None) != (self.engine_info.pooler is None):
            raise ValueError("pooling: this engine " + (
                "generates text; embeddings need one started with --runner pooling"
                if pooling is not None else "runs an embedding model (--runner pooling); it "
                "only embeds (LLM.embed, /v1/embeddings)"))
        self._check_usable()
        if lora_request is not None:
            self.check_lora(lora_request)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        check_priority(priority, self.engine_info.scheduling_policy)
        request_id = request_id or uuid.uuid4().hex
        if not is_valid_unicode(request_id):
            raise ValueError("request_id must be valid Unicode (no lone surrogates)")
        if prompt_ids is None:
            prompt_ids = self.encode_prompt(prompt)
        messages = self._processor.add_request(
            request_id, f"{self.client_id}-{request_id}",
            prompt if isinstance(prompt, str) else None, prompt_ids, params,
            self.engine_info.max_model_len, priority=priority, final_only=final_only,
            stream_interval=interval, lora_request=lora_request, pooling=pooling)
        collector = RequestOutputCollector()
        self._collectors[request_id] = collector
        for msg in messages:
            self._client.send_nowait(msg)
        return request_id, collector

    def check_lora(self, lora_request: LoRARequest) -> None:
        """ValueError naming lora_request when the engine serves no adapters or the folder is
        not one it can run (`ipc/lora.py`); workers read the weights themselves."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got "
                             f"{type(lora_request).__name__}")
        if not self.engine_info.max_lora_rank:
            raise ValueError(f"lora_request {lora_request.lora_name!r} needs an engine "
                             "started with --enable-lora")
        read_adapter_config(lora_request.lora_path, self.engine_info.max_lora_rank)

    async def abort(self, request_id: str) -> None:
        """Abort a request; its generator ends with finish_reason "abort". Unknown ids: no-op."""
        output, engine_ids = self._processor.finish_request(request_id, "abort")
        if engine_ids:
            self._client.send_nowait(Abort(engine_ids))
        if output is not None and request_id in self._collectors:
            self._collectors[request_id].put(output)

    def _abort_quietly(self, request_id: str) -> None:
        engine_ids = self._processor.abort_request(request_id)
        if engine_ids and not self.dead:
            self._client.send_nowait(Abort(engine_ids))

    @property
    def num_engine_restarts(self) -> int:
        """Times the private daemon was started again, over this frontend's lifetime."""
        return self.supervisor.budget.total if self.supervisor is not None else 0

    def num_unfinished_requests(self) -> int:
        """This frontend's requests still in flight."""
        return self._processor.num_unfinished_requests()

    async def get_stats(self, view_since: int = -1) -> SchedulerStats:
        """A fresh snapshot of the engine core's statistics (the whole server); with
        `view_since` 0 or more, the live batch view's steps after that step id too
        (`SchedulerStats.view`, absent from an answer that another query asked for)."""
        self._check_usable()
        fut = asyncio.get_running_loop().create_future()
        self._stats_waiters.append(fut)
        self._client.send_nowait(StatsQuery(self.client_id, view_since))
        try:
            return await asyncio.wait_for(fut, _STATS_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise RuntimeError(f"engine core sent no statistics within {_STATS_TIMEOUT_S} s") \
                from None
        finally:
            if fut in self._stats_waiters:
                self._stats_waiters.remove(fut)

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("this AsyncLLM is closed")
        if self.dead:
            raise RuntimeError(f"the engine core is dead: {self.dead_reason}")
        if not self._client.attached:
            raise EngineUnavailable(f"no engine core is attached ({self.away_reason}); this "
                                    f"frontend re-attaches when one answers at "
                                    f"{self._client.address}")

    @property
    def attached(self) -> bool:
        """Whether an engine core serves this frontend now (False while away, or dead)."""
        return self._client.attached and not self.dead

    def fail_requests(self, reason: str) -> None:
        """End every pending request now with finish_reason "error" and `reason`, and abort
        them in the engine core (for a server that shuts down, say)."""
        engine_ids = self._processor.engine_req_ids()
        if engine_ids and self.attached:
            self._client.send_nowait(Abort(engine_ids))
        self._fail_pending(reason)

    # -- background tasks -----------------------------------------------------------------

    async def _output_loop(self) -> None:
        try:
            while not self.dead:
                msg = await self._client.recv()
                if isinstance(msg, EngineOutputs):
                    await self._handle_outputs(msg)
                elif isinstance(msg, EngineInfo):
                    self._on_info(msg)
                elif isinstance(msg, (EngineDead, Detached)):
                    self._on_lost(msg)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - never leave requests hanging
            logger.exception("output handler failed")
            self._on_dead(f"the frontend's output handler failed: {e!r}")

    async def _handle_outputs(self, msg: EngineOutputs) -> None:
        outputs = msg.outputs
        for start in range(0, len(outputs), _OUTPUT_CHUNK):
            if start:
                await asyncio.sleep(0)  # let consumers run between big chunks
            chunk = outputs[start:start + _OUTPUT_CHUNK]
            self.num_generated_tokens += sum(len(o.new_token_ids) for o in chunk) // 4
            processed = self._processor.process_outputs(chunk)
            if processed.reqs_to_abort:
                self._client.send_nowait(Abort(processed.reqs_to_abort))
            self._deliver(processed.request_outputs)
            self._deliver_refusals(processed.refused)
        if msg.stats is not None:
            self.latest_stats = msg.stats
            for fut in self._stats_waiters:
                if not fut.done():
                    fut.set_result(msg.stats)
            self._stats_waiters.clear()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            collector = self._collectors.get(output.request_id)
            if collector is not None:
                collector.put(output)

    def _deliver_refusals(self, refused: dict[str, str]) -> None:
        for request_id, error in refused.items():
            collector = self._collectors.get(request_id)
            if collector is not None:
                collector.fail(ValueError(error))

    async def _watch_daemon(self) -> None:
        """Start our daemon again when it dies (at most max_engine_restarts times within 10
        minutes: `Supervisor`); the client re-attaches to it at the same address
        (`_on_info`)."""
        supervisor = self.supervisor
        while True:
            while supervisor.alive():
                await asyncio.sleep(_DAEMON_POLL_S)
            if self._closed:
                return
            if not supervisor.may_restart(then=f"; {self.num_unfinished_requests()} "
                                          "unfinished requests wait for it"):
                self._on_dead(supervisor.final_reason)
                return
            self._on_lost(EngineDead("the engine core process died"))  # if not seen yet
            await _in_own_thread(supervisor.stop)  # its workers, if any are left
            if self._closed:
                return
            supervisor.start()

    def _on_lost(self, msg: EngineDead | Detached) -> None:
        """The core went away or dropped us: suspend every pending request until a core
        answers at the address again (`_on_info` resubmits them) or the restart timeout
        ends them."""
        if not self._client.attached:
            return  # away already: an answer to a frame sent before our new Hello
        if self.supervisor is not None and self._client.core_silent:
            # `_watch_daemon` starts it again
            self.supervisor.kill_hung("echoed no heartbeat for its --frontend-timeout")
        if (self.supervisor is not None and isinstance(msg, EngineDead)
                and self.supervisor.budget.limit == 0):
            self._on_dead(msg.reason)
            return
        engine_ids = self._processor.engine_req_ids()
        self.away_reason = msg.reason
        self._client.reattach()
        if engine_ids:  # the core may know them still (a connection lost, not the core)
            self._client.send_nowait(Abort(engine_ids))
        self._fail_stats_waiters(msg.reason)
        if self.engine_restart_timeout <= 0:
            logger.error("engine core at %s: %s; failing %d unfinished requests, re-attaching "
                         "when a core answers", self._client.address, msg.reason,
                         self.num_unfinished_requests())
            self._fail_pending(msg.reason)
            return
        logger.warning("engine core at %s: %s; %d unfinished requests wait up to %g s for a "
                       "core to answer there, then are resubmitted", self._client.address,
                       msg.reason, self.num_unfinished_requests(),
                       self.engine_restart_timeout)
        if self._give_up is not None:
            self._give_up.cancel()
        self._give_up = asyncio.get_running_loop().call_later(
            self.engine_restart_timeout, self._on_restart_timeout, msg.reason)

    def _on_restart_timeout(self, reason: str) -> None:
        self._give_up = None
        if self._client.attached or self.dead:
            return
        reason = (f"{reason}; no engine core answered at {self._client.address} within "
                  f"{self.engine_restart_timeout:g} s")
        logger.error("%s; failing %d unfinished requests", reason,
                     self.num_unfinished_requests())
        self._fail_pending(reason)

    def _on_info(self, info: EngineInfo) -> None:
        """A core answered our Hello: attached again, if it serves the same model; every
        unfinished request is resubmitted to it."""
        if self._client.attached:
            return  # a second answer (Hello is sent again on each new connection)
        old = self.engine_info
        if (info.model, info.tokenizer) != (old.model, old.tokenizer):
            self.away_reason = (f"the engine core at {self._client.address} now serves "
                                f"{info.model}, not {old.model}")
            logger.error("%s: not re-attaching", self.away_reason)
            return
        self.engine_info, self.away_reason = info, None
        self._client.on_attached(info)
        if self._give_up is not None:
            self._give_up.cancel()
            self._give_up = None
        messages, finished = self._processor.resubmit_all()
        for msg in messages:
            self._client.send_nowait(msg)
        self.num_resubmitted += len(messages)
        self._deliver(finished)
        logger.info("re-attached to the engine core at %s; resubmitted %d engine requests",
                    self._client.address, len(messages))

    def _on_dead(self, reason: str) -> None:
        if self.dead:
            return
        self.dead, self.dead_reason = True, reason
        if self._give_up is not None:
            self._give_up.cancel()
            self._give_up = None
        if not self._closed:
            logger.error("engine core is dead: %s", reason)
        self._fail_pending(reason)

    def _fail_pending(self, reason: str) -> None:
        """Every request in flight ends with "error" and `reason`; stats waiters raise."""
        self._deliver(self._processor.fail_all(reason))
        self._fail_stats_waiters(reason)

    def _fail_stats_waiters(self, reason: str) -> None:
        for fut in self._stats_waiters:
            if not fut.done():
                fut.set_exception(RuntimeError(f"the engine core went away: {reason}"))
        self._stats_waiters.clear()

    # -- shutdown -------------------------------------------------------------------------

    async def close(self) -> None:
        """Detach (Goodbye); stop the daemon if this object started it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._give_up is not None:
            self._give_up.cancel()
        self._deliver(self._processor.fail_all("the frontend was closed", "abort"))
        await self._client.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.supervisor is not None:
            await _in_own_thread(self.supervisor.stop)

    @property
    def daemon_pid(self) -> int | None:
        """The private daemon's pid, or None when attached to someone else's."""
        return self.supervisor.child.pid if self.supervisor is not None else None

    async def __aenter__(self) -> "AsyncLLM":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
