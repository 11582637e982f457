"""generator.engines.upstream.pool: several servers of one model (``--upstream A --upstream B``). A server that cannot
be reached is skipped (and marked down), and a generation cut by its server's death midway is continued on
another, exactly as a crashed worker's is: handed over, claimed again, continued from the stream's text."""

from __future__ import annotations

import threading

import redis
from helpers import create, eventually, read_sse, stored_text, wait_status
from scripted_upstream import Reply, ScriptedUpstream, text
from servers import StackFactory

from broker.redis.server import RedisServer, free_port
from broker.request.generation import GenerationRequest, Message
from generator.engines.upstream import UpstreamEngine
from generator.engines.upstream.protocol import CONTINUE_INSTRUCTION


async def test_a_server_that_cannot_be_reached_is_skipped_and_marked_down() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with ScriptedUpstream() as up:
        engine = UpstreamEngine([dead, up.url], model="scripted-model")
        request = GenerationRequest(messages=(Message("user", "hi"),), prompt=None, model=None, max_tokens=8,
                                    temperature=0.0, top_p=1.0, seed=None, stop=(), cancel_on_disconnect=False)
        for _ in range(2):
            gen = engine.start(request, prefix_text="", max_tokens=8, stop=threading.Event())
            assert gen.apieces is not None
            assert "".join([p async for p in gen.apieces if isinstance(p, str)]) == "Hello there!"
        assert [s.up for s in engine.pool.servers] == [False, True]
        assert len(up.bodies()) == 2
        engine.close()


async def test_a_server_marked_down_serves_again_once_its_health_check_answers() -> None:
    # The watcher asks every server its model list each HEALTH_INTERVAL_S; the check it runs is called here.
    port = free_port()
    request = GenerationRequest(messages=(Message("user", "hi"),), prompt=None, model=None, max_tokens=8,
                                temperature=0.0, top_p=1.0, seed=None, stop=(), cancel_on_disconnect=False)

    async def answer(engine: UpstreamEngine) -> str:
        gen = engine.start(request, prefix_text="", max_tokens=8, stop=threading.Event())
        assert gen.apieces is not None
        return "".join([p async for p in gen.apieces if isinstance(p, str)])

    with ScriptedUpstream() as other:
        engine = UpstreamEngine([f"http://127.0.0.1:{port}", other.url], model="scripted-model")
        try:
            assert await answer(engine) == "Hello there!"
            late = engine.pool.servers[0]
            assert not late.up and not await engine.pool.check(late)  # still nothing there
            with ScriptedUpstream(port=port) as back:
                assert await engine.pool.check(late) and late.up
                for _ in range(2):  # in turn among the servers up, both idle: it takes one of the two
                    assert await answer(engine) == "Hello there!"
                assert len(back.bodies()) == 1 and len(other.bodies()) == 2
        finally:
            engine.close()


def test_a_generation_whose_upstream_dies_midway_is_continued_on_another(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis) -> None:
    first = ScriptedUpstream().start()
    second = ScriptedUpstream().start()
    try:
        # The first server streams four words, then holds the stream open: it dies there.
        first.script(Reply([text(f" w{i}") for i in range(4)], delay_s=0.05, hold=True))
        second.script(Reply([text(" and"), text(" more.")]))
        s = stack_factory(redis_server.url)
        s.consumer()
        s.generator("--upstream", f"{first.url},{second.url}", ignore_eos=False)
        with s.client() as c:
            sid = create(c, messages=[{"role": "user", "content": "Tell me"}], max_tokens=50).json()["id"]
            eventually(lambda: stored_text(redis_client, sid) == " w0 w1 w2 w3", 20)
            first.stop()  # the server dies mid-answer
            wait_status(c, sid, {"done"})
            read = read_sse(c, f"/v1/streams/{sid}/events")
        assert read.text == " w0 w1 w2 w3 and more."
        assert [e.event for e in read.events].count("started") == 1 and read.events[-1].event == "done"
        # The second server was asked to go on from the text the stream holds, as after a crash.
        [body] = second.bodies()
        assert body["messages"][-2:] == [{"role": "assistant", "content": " w0 w1 w2 w3"},
                                         {"role": "user", "content": CONTINUE_INSTRUCTION}]
        assert "handed the job over" in s.procs[-1].output()
    finally:
        first.stop()
        second.stop()
