"""A bounded load against a real scoring server (`pipeline serve`'s command on 127.0.0.1, a tiny target): 1, 2 and
4 concurrent clients are all answered with the target's greedy answers; a request that cannot fit gets HTTP 429
at once; a client that hangs up mid-generation costs nobody else an answer."""
import socket
import time

import torch
from test_serving import plain_greedy, served_champion

from pipeline.bench.load import post, run_load, same_as_reference
from pipeline.serving.settings import MAX_BATCH_ENV, MAX_QUEUE_ENV, POLICY_ENV
from runtime.target.precision import float_dtype

PROMPTS = ["w5 w6 w7 w5 w6 w7", "w40 w41 w40 w41", "w9 w8 w9", "w60 w61 w62 w60", "w70 w12 w70"]
NEW_TOKENS = 12


def hang_up_mid_request(port: int, prompt: str, max_new_tokens: int) -> None:
    """Send a request and close the connection without reading the answer."""
    body = ('{"dataframe_records": [{"prompt": "%s", "max_new_tokens": %d}]}' % (prompt, max_new_tokens)).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /invocations HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        time.sleep(0.5)


def test_bounded_load_on_a_real_server(tmp_path, tiny_chat_target):  # noqa: F811 - the fixture
    from transformers import AutoTokenizer

    # a home of its own: a policy kept by an earlier run would not be measured at load
    env = {MAX_BATCH_ENV: "4", MAX_QUEUE_ENV: "8", POLICY_ENV: "measured", "DRAFTSMITH_HOME": str(tmp_path / "home")}
    with served_champion(tmp_path, tiny_chat_target, tiny_chat_target, env) as (cfg, port, log):
        url = f"http://127.0.0.1:{port}"
        tokenizer = AutoTokenizer.from_pretrained(tiny_chat_target)
        count = lambda text: len(tokenizer(text, add_special_tokens=False).input_ids)  # noqa: E731
        results = [run_load(url, PROMPTS, c, 2 * c, NEW_TOKENS, count, timeout_s=300) for c in (1, 2, 4)]
        start = time.monotonic()
        status, error = post(url, [{"prompt": "w5"}] * 13, timeout_s=60)
        refused_s = time.monotonic() - start
        hang_up_mid_request(port, PROMPTS[0], 60)
        after = run_load(url, PROMPTS, 2, 2, NEW_TOKENS, count, timeout_s=300)
    dtype = float_dtype(cfg.validate.precision, torch.device("cpu"))
    reference = dict(zip(PROMPTS, (plain_greedy(tiny_chat_target, [p], NEW_TOKENS, dtype)[0] for p in PROMPTS)))
    for r in results + [after]:
        assert r["answered"] == r["requests"] and not r["errors"], r["errors"]
        assert same_as_reference(r, PROMPTS, reference)
        assert r["tokens"] > 0 and r["p50_s"] <= r["p99_s"]
    assert status == 429 and "a request of 13 rows can never fit" in error and refused_s < 30
    assert "serving 4 rows at once, a queue of 8" in log.read_text() and "batch policy: time batched steps" in \
        log.read_text()  # measured at load
