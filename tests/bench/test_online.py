"""`proxima bench` online mode end to end, against real HTTP servers on 127.0.0.1.

Timing assertions use only bounds that sleeping guarantees (a stream cannot end before
the server has slept between its chunks), never upper bounds on a shared machine.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest

from proxima.cli import main
from proxima.workloads import load_trace

PAIRS = [(12, 5), (30, 8), (7, 3), (50, 6), (21, 4), (9, 7)]      # (prompt_len, output_len)


def bench(tmp_path, *argv):
    """Run the CLI; return (exit status, parsed JSON or None)."""
    out = tmp_path / "result.json"
    rc = main(["bench", "--no-progress", "--json", str(out), *argv])
    return rc, (json.loads(out.read_text()) if out.exists() else None)


def test_figures_match_what_the_server_streamed(fake_server, trace_file, tmp_path):
    server = fake_server(delay=0.002, preemptions_per_request=2)
    trace = trace_file(PAIRS)
    rc, rep = bench(tmp_path, "--base-url", server.url, "--model", "tiny", "--trace", trace,
                    "--concurrency", "2")
    assert rc == 0
    res = rep["results"]["A"]
    n, want_out = len(PAIRS), sum(o for _, o in PAIRS)
    assert (res["requests"], res["completed"], res["errors"]) == (n, n, 0)
    assert res["output_tokens"] == want_out == server.state.tokens_streamed
    assert res["output_tokens_source"] == "usage"
    assert res["short_outputs"] == 0
    assert res["prompt_tokens"] == sum(p for p, _ in PAIRS)
    assert res["preemptions"] == 2 * n
    assert res["requests_per_s"] == pytest.approx(n / res["duration_s"])
    assert res["output_tokens_per_s"] == pytest.approx(want_out / res["duration_s"])
    assert res["total_tokens_per_s"] == pytest.approx(
        (want_out + res["prompt_tokens"]) / res["duration_s"])
    # every stream slept output_len times `delay`: a lower bound on e2e, and with 2 in
    # flight an upper bound on the request rate
    min_e2e = min(o for _, o in PAIRS) * 0.002
    assert res["e2e_ms"]["p50"] >= min_e2e * 1000
    assert res["requests_per_s"] <= 2 / min_e2e
    for q in ("p50", "p90", "p99"):
        assert 0 < res["ttft_ms"][q] <= res["e2e_ms"][q]
        assert res["itl_ms"][q] <= res["e2e_ms"][q]
    assert res["ttft_ms"]["n"] == res["e2e_ms"]["n"] == n
    assert res["itl_ms"]["n"] == sum(o - 1 for _, o in PAIRS)   # one gap between each chunk
    # the server saw exactly the workload, as token ids, with the vLLM extensions
    specs = load_trace(trace).requests
    received = sorted((b["prompt"], b["max_tokens"]) for b in server.state.bodies)
    assert received == sorted((s.prompt_token_ids, s.max_tokens) for s in specs)
    for body in server.state.bodies:
        assert body["ignore_eos"] is True and body["temperature"] == 0 and body["stream"] is True


def test_output_tokens_come_from_usage_not_chunk_count(fake_server, trace_file, tmp_path):
    server = fake_server(tokens_per_chunk=3)
    rc, rep = bench(tmp_path, "--base-url", server.url, "--model", "tiny",
                    "--trace", trace_file(PAIRS))
    res = rep["results"]["A"]
    assert rc == 0
    assert res["output_tokens"] == sum(o for _, o in PAIRS)
    assert server.state.chunks_streamed < res["output_tokens"]
    assert res["itl_ms"]["n"] == server.state.chunks_streamed - len(PAIRS)
    assert res["short_outputs"] == 0


def test_two_servers_get_identical_request_lists_and_a_ratio(fake_server, trace_file, tmp_path,
                                                             capsys):
    a = fake_server(delay=0.001, preemptions_per_request=0)
    b = fake_server(delay=0.003, preemptions_per_request=1)
    rc, rep = bench(tmp_path, "--base-url", a.url, "--label", "stock", "--base-url", b.url,
                    "--label", "proxima", "--model", "tiny", "--trace", trace_file(PAIRS),
                    "--concurrency", "3", "--plot", str(tmp_path / "p.png"))
    assert rc == 0
    key = lambda body: (tuple(body["prompt"]), body["max_tokens"])  # noqa: E731
    assert Counter(map(key, a.state.bodies)) == Counter(map(key, b.state.bodies))
    assert len(a.state.bodies) == len(PAIRS)
    assert list(rep["results"]) == ["stock", "proxima"]
    assert list(rep["ratios"]) == ["proxima/stock"]
    ratios, sa, sb = rep["ratios"]["proxima/stock"], rep["results"]["stock"], rep["results"]["proxima"]
    assert ratios["output_tokens_per_s"] == pytest.approx(sb["output_tokens_per_s"] / sa["output_tokens_per_s"])
    assert ratios["e2e_ms.p90"] == pytest.approx(sb["e2e_ms"]["p90"] / sa["e2e_ms"]["p90"])
    assert sa["preemptions"] == 0 and sb["preemptions"] == len(PAIRS)
    assert rep["mode"] == "online"
    assert rep["workload"]["requests"] == len(PAIRS) and rep["workload"]["concurrency"] == 3
    out = capsys.readouterr().out
    assert "proxima/stock" in out and "TTFT p99 (ms)" in out and "preemptions" in out
    png = (tmp_path / "p.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_second_bad_server_stops_before_any_load(fake_server, trace_file, tmp_path, capsys):
    good = fake_server()
    other = fake_server(models=("other-model",))
    rc = main(["bench", "--no-progress", "--base-url", good.url, "--base-url", other.url,
               "--model", "tiny", "--trace", trace_file(PAIRS)])
    err = capsys.readouterr().err
    assert rc == 2
    assert good.state.bodies == []                     # checked first, loaded never
    assert "does not serve model 'tiny'" in err and "other-model" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_failed_requests_are_counted_not_raised(fake_server, trace_file, tmp_path, capsys):
    server = fake_server(fail_every=3)
    rc, rep = bench(tmp_path, "--base-url", server.url, "--model", "tiny",
                    "--trace", trace_file(PAIRS), "--concurrency", "2")
    res = rep["results"]["A"]
    assert rc == 1                                     # printed and written, not trustworthy
    assert rep["trustworthy"] is False
    assert rep["notes"] == ["server A: 2 of 6 requests failed (left out of its figures)"]
    assert res["errors"] == len(PAIRS) // 3 and res["completed"] == len(PAIRS) - len(PAIRS) // 3
    assert res["output_tokens"] == server.state.tokens_streamed
    [(message, count)] = res["error_samples"].items()
    assert message.startswith("HTTP 500") and count == res["errors"]
    assert res["e2e_ms"]["n"] == res["completed"]
    assert "HTTP 500" in capsys.readouterr().out


def test_error_inside_the_stream_is_an_error(fake_server, trace_file, tmp_path):
    server = fake_server(stream_error_every=2)
    rc, rep = bench(tmp_path, "--base-url", server.url, "--model", "tiny",
                    "--trace", trace_file(PAIRS), "--concurrency", "1")
    res = rep["results"]["A"]
    assert rc == 1
    assert res["errors"] == len(PAIRS) // 2
    assert all("injected stream error" in m for m in res["error_samples"])
    assert res["output_tokens"] == server.state.tokens_streamed


def test_every_request_failing_exits_1_with_a_report(fake_server, trace_file, tmp_path, capsys):
    server = fake_server(fail_every=1)
    rc, rep = bench(tmp_path, "--base-url", server.url, "--model", "tiny",
                    "--trace", trace_file(PAIRS[:2]))
    assert rc == 1
    res = rep["results"]["A"]
    assert res["completed"] == 0 and res["requests_per_s"] == 0
    assert res["ttft_ms"]["p50"] is None
    assert "completed no request" in capsys.readouterr().err


def test_timeout_is_an_error_per_request(fake_server, trace_file, tmp_path):
    server = fake_server(delay=0.2)               # 5 tokens take 1 s; the limit is 0.1 s
    rc, rep = bench(tmp_path, "--base-url", server.url, "--model", "tiny",
                    "--trace", trace_file([(5, 5), (5, 5)]), "--timeout", "0.1")
    res = rep["results"]["A"]
    assert rc == 1 and res["errors"] == 2
    assert all("timed out after 0.1 s" in m for m in res["error_samples"])


@pytest.mark.parametrize("style", ["bare", "none"])
def test_preemption_metric_names(fake_server, trace_file, tmp_path, capsys, style):
    server = fake_server(metrics=style, preemptions_per_request=1)
    rc, rep = bench(tmp_path, "--base-url", server.url, "--model", "tiny",
                    "--trace", trace_file(PAIRS[:3]))
    assert rc == 0
    if style == "bare":
        assert rep["results"]["A"]["preemptions"] == 3
    else:
        assert rep["results"]["A"]["preemptions"] is None
        line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("preemptions"))
        assert line.split()[-1] == "unknown"


def test_chat_endpoint_sends_the_same_text_to_both_servers(fake_server, trace_file, tmp_path):
    a, b = fake_server(), fake_server()
    rc, rep = bench(tmp_path, "--base-url", a.url, "--base-url", b.url, "--model", "tiny",
                    "--trace", trace_file(PAIRS), "--endpoint", "chat", "--concurrency", "1")
    assert rc == 0
    texts = [body["messages"][0]["content"] for body in a.state.bodies]
    assert texts == [body["messages"][0]["content"] for body in b.state.bodies]
    assert len(set(texts)) == len(PAIRS)
    for label in ("A", "B"):
        res = rep["results"][label]
        assert res["output_tokens"] == sum(o for _, o in PAIRS) and res["short_outputs"] == 0
        assert res["prompt_tokens"] == sum(p for p, _ in PAIRS)   # one word per token id
        assert res["itl_ms"]["n"] == sum(o - 1 for _, o in PAIRS)  # the role chunk is no token


def test_server_without_usage_counts_one_token_per_chunk(fake_server, trace_file, tmp_path):
    server = fake_server(usage=False, tokens_per_chunk=2)
    rc, rep = bench(tmp_path, "--base-url", server.url, "--model", "tiny",
                    "--trace", trace_file(PAIRS), "--endpoint", "chat")
    res = rep["results"]["A"]
    assert res["output_tokens_source"] == "chunks"
    assert res["output_tokens"] == server.state.chunks_streamed
    assert res["short_outputs"] == sum(1 for _, o in PAIRS if o > 1)  # visible, not hidden
    assert res["prompt_tokens"] is None and res["total_tokens_per_s"] is None


def test_request_rate_mode_runs_every_request(fake_server, trace_file, tmp_path):
    server = fake_server()
    rc, rep = bench(tmp_path, "--base-url", server.url, "--model", "tiny",
                    "--trace", trace_file(PAIRS), "--request-rate", "200")
    assert rc == 0
    assert rep["results"]["A"]["completed"] == len(PAIRS)
    assert rep["workload"]["request_rate"] == 200 and rep["workload"]["concurrency"] is None


def test_synthetic_workload_and_request_count(fake_server, tmp_path):
    server = fake_server(delay=0.0005)
    rc, rep = bench(tmp_path, "--base-url", server.url + "/v1/", "--model", "tiny",
                    "--workload", "chat", "--requests", "4")
    assert rc == 0
    assert rep["workload"]["name"] == "chat" and rep["workload"]["concurrency"] == 20
    assert rep["results"]["A"]["output_tokens"] == 4 * 100 == server.state.tokens_streamed
    assert rep["results"]["A"]["base_url"] == server.url


def test_repeat_runs_rounds_with_fresh_prompts_and_reports_the_noise_band(fake_server, tmp_path,
                                                                          capsys):
    a = fake_server(delay=0.0005, preemptions_per_request=1)
    b = fake_server(delay=0.0005)
    rc, rep = bench(tmp_path, "--base-url", a.url, "--label", "stock", "--base-url", b.url,
                    "--label", "proxima", "--model", "tiny", "--workload", "chat",
                    "--requests", "5", "--repeat", "3", "--seed", "7")
    assert rc == 0 and rep["partial"] is False and rep["workload"]["repeat"] == 3
    # every server got each round's list once; the rounds' prompts differ (seeds 7, 8, 9)
    key = lambda body: tuple(body["prompt"])  # noqa: E731
    assert Counter(map(key, a.state.bodies)) == Counter(map(key, b.state.bodies))
    assert len(a.state.bodies) == 15 and len(set(map(key, a.state.bodies))) == 15
    err = capsys.readouterr().err
    assert "round 1/3 (seed 7): stock, proxima" in err
    assert "round 2/3 (seed 8): proxima, stock" in err          # order reversed
    for label in ("stock", "proxima"):
        res = rep["results"][label]
        per = res["per_round"]
        assert res["rounds"] == 3 and len(per) == 3
        assert res["completed"] == 15 and res["output_tokens"] == 15 * 100
        tps = sorted(p["output_tokens_per_s"] for p in per)
        assert res["output_tokens_per_s"] == pytest.approx(tps[1])
        assert res["output_tokens_per_s_spread"]["spread_pct"] == pytest.approx(
            (tps[2] - tps[0]) / tps[1] * 100)
        assert res["e2e_ms"]["n"] == 15
        assert res["e2e_ms"]["p90"] == pytest.approx(sorted(p["e2e_ms"]["p90"] for p in per)[1])
    assert rep["results"]["stock"]["preemptions"] == 15
    assert rep["ratios"]["proxima/stock"]["output_tokens_per_s"] == pytest.approx(
        rep["results"]["proxima"]["output_tokens_per_s"]
        / rep["results"]["stock"]["output_tokens_per_s"])
    rc, _ = bench(tmp_path, "--base-url", a.url, "--model", "tiny", "--workload", "chat",
                  "--requests", "2", "--repeat", "2")
    table = capsys.readouterr().out
    assert rc == 0 and "run-to-run spread (%)" in table and "2 rounds" in table


def test_a_server_killed_mid_run_gives_errors_and_exit_1_never_completions(trace_file, tmp_path,
                                                                          capsys):
    """The stand-in server runs in its own process and SIGKILLs itself midway through the
    40th of 200 streams: the streams it cut are errors (not short completions), the
    requests after it fail to connect, and the exit status says the figures cannot be
    trusted; the report is still printed and written."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    server = subprocess.Popen([sys.executable, "-m", "tests.bench.standin_server",
                               "--die-after", "40", "--delay", "0.003"],
                              cwd=repo, stdout=subprocess.PIPE, text=True)
    try:
        url = server.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), url
        rc, rep = bench(tmp_path, "--base-url", url, "--model", "tiny", "--concurrency", "8",
                        "--trace", trace_file([(8, 10)] * 200), "--timeout", "60")
        server.wait(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    assert server.returncode == -signal.SIGKILL            # it really died mid-run
    assert rc == 1
    res = rep["results"]["A"]
    assert res["requests"] == 200 and res["completed"] + res["errors"] == 200
    assert 0 < res["completed"] < 40                       # only what ended with [DONE]
    assert res["short_outputs"] == 0                       # a cut stream is no completion
    assert res["output_tokens"] == 10 * res["completed"]
    cut = res["error_samples"].get("stream cut before [DONE] (the connection closed "
                                   "mid-answer: did the server die?)", 0)
    assert cut >= 1
    assert rep["trustworthy"] is False
    assert rep["notes"] == [f"server A: {res['errors']} of 200 requests failed (left out of "
                            f"its figures)"]
    assert res["preemptions"] is None                      # /metrics is gone with it
    err = capsys.readouterr().err
    assert "proxima bench: not trustworthy: server A:" in err and "Traceback" not in err


def test_vllm_bench_serve_flag_names(fake_server, tmp_path, capsys, monkeypatch):
    """`vllm bench serve`'s spellings: --num-prompts, --max-concurrency, --dataset-name,
    --endpoint PATH, --disable-tqdm, --save-result/--result-filename/--result-dir, and no
    --model (the server's first model)."""
    server = fake_server(models=("first", "second"), delay=0.0005)
    out = tmp_path / "saved.json"
    rc = main(["bench", "--base-url", server.url, "--dataset-name", "pressure",
               "--num-prompts", "6", "--max-concurrency", "2", "--endpoint", "/v1/completions",
               "--disable-tqdm", "--save-result", "--result-filename", str(out)])
    assert rc == 0
    rep = json.loads(out.read_text())
    w = rep["workload"]
    assert (w["name"], w["requests"], w["concurrency"], w["endpoint"], w["model"]) == \
        ("pressure", 6, 2, "completions", "first")
    assert {b["model"] for b in server.state.bodies} == {"first"}
    assert server.state.peak_active <= 2
    err = capsys.readouterr().err
    assert "--model not given: using 'first', the first model of server A" in err
    assert "%|" not in err                                 # --disable-tqdm: no bar
    # --save-result without a name: vllm's pattern, in --result-dir (made if missing)
    monkeypatch.chdir(tmp_path)
    rc = main(["bench", "--base-url", server.url, "--model", "second", "--num-prompts", "2",
               "--max-concurrency", "1", "--disable-tqdm", "--save-result",
               "--result-dir", "results"])
    assert rc == 0
    [saved] = (tmp_path / "results").iterdir()
    assert saved.name.startswith("proxima-infqps-concurrency1-second-") and \
        saved.suffix == ".json"
    assert json.loads(saved.read_text())["workload"]["model"] == "second"


def test_request_rate_with_max_concurrency_caps_the_streams_in_flight(fake_server, tmp_path):
    """As in vllm bench serve: --request-rate paces the starts, --max-concurrency caps how
    many run at once (a start waits for a free slot)."""
    server = fake_server(delay=0.005)
    rc, rep = bench(tmp_path, "--base-url", server.url, "--workload", "chat",
                    "--requests", "12", "--request-rate", "1000", "--max-concurrency", "3")
    assert rc == 0 and rep["results"]["A"]["completed"] == 12
    assert rep["workload"]["request_rate"] == 1000 and rep["workload"]["concurrency"] == 3
    assert 1 < server.state.peak_active <= 3
    rc, rep = bench(tmp_path, "--base-url", server.url, "--workload", "chat", "--requests", "4",
                    "--request-rate", "inf")           # vllm's default: all at once
    assert rc == 0 and rep["workload"]["request_rate"] is None
    assert rep["workload"]["concurrency"] == 20            # the chat workload's own


@pytest.mark.parametrize("signame, status", [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_signal_mid_bench_keeps_the_rounds_measured(fake_server, trace_file, tmp_path,
                                                      signame, status):
    """`proxima bench --repeat K` as a user runs it, stopped once round 2 started (its line
    on stderr): exit 143 for SIGTERM (it used to die with the signal), 130 for SIGINT; the
    JSON holds the rounds finished, whole (no temporary file left), their table is printed
    (it was not: without --json they were lost), stderr says how many were kept and why it
    stopped, no traceback."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    server = fake_server(delay=0.002)
    trace = trace_file([(8, 4)] * 4)
    out = tmp_path / "r.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [
        str(repo), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, "-m", "proxima.cli", "bench", "--no-progress",
                             "--base-url", server.url, "--model", "tiny", "--trace", trace,
                             "--repeat", "1000", "--json", str(out)],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    seen = []
    try:
        for line in proc.stderr:
            seen.append(line)
            if line.startswith("proxima bench: round 2/1000"):
                break
        else:
            pytest.fail("no round marker:\n" + "".join(seen))
        proc.send_signal(getattr(signal, signame))
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == status, "".join(seen) + stderr
    assert "Traceback" not in stderr, stderr
    word = "terminated (SIGTERM)" if signame == "SIGTERM" else "interrupted"
    assert stderr.strip().splitlines()[-1] == f"proxima bench: {word}"
    rep = json.loads(out.read_text())
    assert rep["partial"] is True and rep["rounds_done"] >= 1
    assert rep["per_round"][0]["A"]["completed"] == 4
    done = rep["rounds_done"]
    assert (f"proxima bench: {word} during round {done + 1} of 1000: keeping the {done} "
            f"finished") in stderr, stderr
    assert rep["results"]["A"]["requests"] > 0 and len(rep["per_round"]) == done
    assert stdout.splitlines()[0].startswith("online benchmark") and "completed" in stdout
    assert f"{done} of 1000 rounds (medians" in stdout.splitlines()[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "trace.jsonl"]


def test_a_bench_killed_between_rounds_leaves_the_report_of_the_rounds_done(
        fake_server, trace_file, tmp_path):
    """`proxima bench --repeat K --json` rewrites the JSON after every round; a bench killed
    outright (SIGKILL, no handler runs) leaves that file. It was a dict of its own, without
    the merged figures a Ctrl-C's report has: now the same partial report, its table
    readable."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from proxima.bench import report as report_mod

    repo = Path(__file__).resolve().parents[2]
    server = fake_server(delay=0.002)
    out = tmp_path / "r.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [
        str(repo), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, "-m", "proxima.cli", "bench", "--no-progress",
                             "--base-url", server.url, "--model", "tiny", "--trace",
                             trace_file([(8, 4)] * 4), "--repeat", "1000", "--json", str(out)],
                            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:
            if line.startswith("proxima bench: round 3/1000"):
                break
        else:
            pytest.fail("no round marker")
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    rep = json.loads(out.read_text())
    assert rep["partial"] is True and (rep["rounds_done"], rep["rounds_planned"]) == (2, 1000)
    assert rep["mode"] == "online" and rep["workload"]["repeat"] == 1000
    assert [r["A"]["completed"] for r in rep["per_round"]] == [4, 4]
    assert rep["results"]["A"]["completed"] == 8 and rep["trustworthy"] is True
    assert "ratios" in rep and rep["notes"] == [] and "environment" in rep
    assert "2 of 1000 rounds (medians" in report_mod.format_table(rep).splitlines()[0]
