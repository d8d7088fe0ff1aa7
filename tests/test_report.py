"""`mappa report RUN_DIR`: reading a run's logs, escaping agent text, and the page as Chromium renders it."""

import asyncio
import json
import re
import subprocess
from types import SimpleNamespace

import pytest
from PIL import Image

from conftest import MAPPA, assert_report_renders, chromium, render_report_dom
from openrlhf_mappa.tools import report

HOSTILE = "</script><img src=x onerror=alert(1)><!-- \u2028 \ufffd"


def metrics_row(step, **extra):
    return {"step": step, "outcome/success_rate": 0.5, "agent/solver/coach_score": 4.0 + step,
            "agent/solver/action_length": 10.0, "agent/solver/kl": None, **extra}  # fmt: skip


def write_jsonl(path, rows, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)


def test_reading_tolerates_a_cut_off_last_line_and_names_a_broken_one(tmp_path, capsys):
    write_jsonl(tmp_path / "metrics.jsonl", [metrics_row(1), metrics_row(2)], tail='{"step": 3, "outcome/succ')
    data = report.load_run(str(tmp_path))
    assert data["steps"] == [1, 2] and data["agents"] == ["solver"]
    assert "metrics.jsonl: line 3 is cut off" in capsys.readouterr().err
    curves = {c["title"]: c["series"] for c in data["sections"]["training"]}
    assert curves["agent/*/coach_score"] == [{"name": "solver", "points": [[1, 5.0], [2, 6.0]]}]
    assert list(curves)[:2] == ["outcome/success_rate", "agent/*/coach_score"]  # the page opens with these
    assert "agent/*/kl" not in curves  # null every step: no chart rather than an empty one
    assert data["sections"]["eval"] is None and data["episodes"] == []  # no eval.jsonl, no episodes.jsonl

    (tmp_path / "metrics.jsonl").write_text(json.dumps(metrics_row(1)) + "\n{broken\n" + json.dumps(metrics_row(2)) + "\n")
    with pytest.raises(ValueError, match="metrics.jsonl: line 2: broken JSON"):
        report.load_run(str(tmp_path))
    with pytest.raises(ValueError, match="no metrics.jsonl"):
        report.load_run(str(tmp_path / "missing"))


def test_no_kl_chart_at_beta_0(tmp_path):
    # At β = 0 an agent has no reference model and its KL is logged as 0 every step: the report once drew that flat
    # line as a KL curve; docs/reference.md says the chart appears only with β > 0.
    rows = [metrics_row(s, **{"agent/solver/kl": 0.0, "agent/solver/kl_coef": 0.0}) for s in (1, 2)]
    write_jsonl(tmp_path / "metrics.jsonl", rows)
    titles = [c["title"] for c in report.load_run(str(tmp_path))["sections"]["training"]]
    assert "agent/*/kl" not in titles and "agent/*/coach_score" in titles
    rows[1]["agent/solver/kl_coef"] = 0.01  # β > 0 (an adaptive KL controller may start it anywhere): drawn
    rows[1]["agent/solver/kl"] = 0.002
    write_jsonl(tmp_path / "metrics.jsonl", rows)
    curves = {c["title"]: c["series"] for c in report.load_run(str(tmp_path))["sections"]["training"]}
    assert curves["agent/*/kl"] == [{"name": "solver", "points": [[1, 0.0], [2, 0.002]]}]

def test_eval_curves_per_dataset(tmp_path):
    write_jsonl(tmp_path / "metrics.jsonl", [metrics_row(1)])
    rows = [{"step": s, "dataset": d, "accuracy": acc, "n_problems": 32, "n_samples": 4, "answered_rate": 1.0}
            for s, d, acc in ((0, "amc_eval_32", 0.1), (0, "gsm", 0.5), (2, "amc_eval_32", 0.25))]  # fmt: skip
    write_jsonl(tmp_path / "eval.jsonl", rows)
    charts = report.load_run(str(tmp_path))["sections"]["eval"]
    assert [c["title"] for c in charts] == ["amc_eval_32 (32 problems x 4 samples)", "gsm (32 problems x 4 samples)"]
    assert charts[0]["series"] == [{"name": "accuracy", "points": [[0, 0.1], [2, 0.25]]},
                                   {"name": "answered_rate", "points": [[0, 1.0], [2, 1.0]]}]  # fmt: skip


def test_eval_accuracy_is_drawn_on_its_own_0_1_axis(tmp_path):
    # Catches the old chart, where accuracy (0-1) shared one axis with coach requests (48), the coach-graded
    # fallback (raw 0-10 scores) and token counts: a 0-50 axis, the curve that matters flat at the bottom.
    write_jsonl(tmp_path / "metrics.jsonl", [metrics_row(1)])
    rows = [{"step": s, "dataset": "relay_eval", "accuracy": a, "accuracy_coach": c, "coach/requests": 48,
             "accuracy_coach/score_fallback": 16, "n_problems": 8, "n_samples": 2}
            for s, a, c in ((0, 0.0, 1.17), (50, 1.0, 10.0))]
    write_jsonl(tmp_path / "eval.jsonl", rows)
    charts = {c["title"]: c for c in report.load_run(str(tmp_path))["sections"]["eval"]}
    assert list(charts) == ["relay_eval (8 problems x 2 samples)", "relay_eval: accuracy_coach",
                            "relay_eval: counts and metrics"]
    accuracy = charts["relay_eval (8 problems x 2 samples)"]
    assert accuracy["scale"] == [0, 1] and [s["name"] for s in accuracy["series"]] == ["accuracy"]
    assert [s["name"] for s in charts["relay_eval: counts and metrics"]["series"]] == [
        "coach/requests", "accuracy_coach/score_fallback"]


def test_agent_text_cannot_break_out_of_the_page(tmp_path):
    write_jsonl(tmp_path / "metrics.jsonl", [metrics_row(1, **{"agent/solver/kl": float("nan")})])
    action = {"agent": "solver", "turn": 0, "response_text": HOSTILE, "feedback": {"stdout": HOSTILE, "exit_code": 0},
              "verdict": {"score": None, "status": "parse_error", "rationale": HOSTILE}, "coach_request": {"task": HOSTILE}}
    episodes = [{"episode_id": f"e{i}", "task_id": "t", "step": 1, "outcome": {"success": True, "metric": float("inf")},
                 "actions": [dict(action, response_text=HOSTILE + "\ud800" if i == 249 else "x" * 10_000)]} for i in range(250)]  # fmt: skip
    write_jsonl(tmp_path / "episodes.jsonl", episodes)
    # In the charts' text too (a title, a legend); a "$" is text, not matplotlib's mathtext.
    write_jsonl(tmp_path / "eval.jsonl", [{"step": 1, "dataset": HOSTILE + " $\\frac$", HOSTILE: 0.5}])
    page = open(report.write_report(str(tmp_path)), encoding="utf-8").read()  # a lone surrogate is written, too
    assert "<img" not in page and "<!--" not in page and page.count("</script>") == 2  # the page's own two blocks
    # escaped in the eval chart's figure and SVG titles, its series' name, its dot's title and its legend
    assert page.count("&lt;/script&gt;&lt;img src=x") == 5
    # No date or version: the same runs give the same page.
    assert "<metadata" not in page and open(report.write_report(str(tmp_path)), encoding="utf-8").read() == page
    payload = page[page.index('id="data">') + len('id="data">') : page.index("</script>")]
    data = json.loads(payload)  # valid JSON: NaN and Infinity became null
    assert data["episodes_total"] == 250 and len(data["episodes"]) == report.MAX_EPISODES
    assert data["episodes"][-1]["actions"][0]["response"] == HOSTILE + "\ud800" and data["episodes"][-1]["task"] == HOSTILE
    assert data["episodes"][0]["outcome"]["metric"] is None and 'data-title="agent/*/kl"' not in page
    clipped = data["episodes"][0]["actions"][0]["response"]
    assert len(clipped) < 4100 and "[... 6000 characters cut ...]" in clipped


def run_dir_from_a_real_rollout(run_dir, tmp_path, steps=3, coach_mode="per_action") -> list:
    """Three steps (or `steps`) of a real rollout (the MathChat environment, code run in the sandbox, the heuristic coach),
    scripted policies standing in for the engines, logged by the trainer's own step_metrics, coach metrics,
    bias audit, write_episodes and log. The newest episode has the hostile reply and a failed verdict."""
    from test_coach import ScriptedPolicy

    from openrlhf_mappa import rewards
    from openrlhf_mappa.cli.train_mappa_ray import parse_args
    from openrlhf_mappa.coach.heuristic import HeuristicCoach
    from openrlhf_mappa.coach.audit import BiasAudit, coach_step_metrics
    from openrlhf_mappa.episode import Verdict
    from openrlhf_mappa.rollout import rollout
    from openrlhf_mappa.team import load_topology
    from openrlhf_mappa.run_log import RunLog, step_metrics

    agents = ["solver", "coder", "verifier"]
    (tmp_path / "t.yaml").write_text(
        "name: t\nenv: mathchat\ncoach_template: 'Output: {agent_output} PROCESS_SCORE:'\nagents:\n"
        + "".join(f"  - {{name: {n}, model: unused, role: r, prompt: '{{task}}', runs_code: {n == 'coder'}}}\n" for n in agents)
    )
    topology = load_topology(str(tmp_path / "t.yaml"))
    args, named = parse_args(["--mappa.topology", "t.yaml"]), [SimpleNamespace(spec=SimpleNamespace(name=n)) for n in agents]
    log = RunLog(args, str(run_dir))
    audit = BiasAudit()
    for step in range(1, steps + 1):
        replies = {"solver": "It is 4." if step < 3 else HOSTILE, "coder": f"```python\nprint(2 + {step - 1})\n```",
                   "verifier": "\\boxed{4}" if step > 1 else "maybe 5"}  # fmt: skip
        policies = {n: ScriptedPolicy(r) for n, r in replies.items()}
        tasks = [{"id": str(i), "prompt": "2 + 2?", "answer": "4"} for i in range(4)]
        episodes = asyncio.run(rollout(topology, tasks, policies, HeuristicCoach(), str(tmp_path / "ws"), step,
                                       coach_mode=coach_mode))
        if step == 3:
            episodes[-1].actions[-1].verdict = Verdict(None, "parse_error", "the coach's reply had no score")
        counts = rewards.assign_rewards(episodes, "process")
        metrics = step_metrics(args, topology, named, {n: n for n in agents}, episodes, {}, {}, {n: 0 for n in agents}, counts,
                               {n: 0.0 for n in agents})
        metrics.update(coach_step_metrics(episodes))
        metrics.update(audit.update(episodes))
        log.episodes(episodes)
        log.metrics(step, metrics)
    return agents


def test_report_renders_in_chromium(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    agents = run_dir_from_a_real_rollout(run_dir, tmp_path)
    write_jsonl(run_dir / "eval.jsonl", [{"step": s, "dataset": "amc_eval_32", "accuracy": a, "n_problems": 32, "n_samples": 4,
                                          "answered_rate": 1.0, "agent/verifier/answer_format_rate": 0.5} for s, a in ((1, 0.1), (3, 0.3))])  # fmt: skip
    out = tmp_path / "page.html"
    proc = subprocess.run([MAPPA, "report", str(run_dir), "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == str(out), proc.stderr

    dom = assert_report_renders(str(out), agents, steps=3, episodes=12)
    charts = {f.attrs["data-title"]: f for f in dom.find_all("figure", "chart")}
    points = {(t, g.attrs["data-series"]): len(g.find_all("use"))
              for t, f in charts.items() for g in f.find_all("g", "series")}
    for a in agents:
        assert points["agent/*/coach_score", a] == points["agent/*/tool_use_rate", a] == 3
        assert points[f"{a}: mean coach score per task type", "math"] == 3
    assert points["coach verdicts by status", "ok"] == points["coach verdicts by status", "parse_error"] == 3
    assert points["final agent's coach score vs outcome", "mean score on success"] == 2  # step 1: no success
    assert points["amc_eval_32 (32 problems x 4 samples)", "accuracy"] == 2
    assert points["amc_eval_32: agent/*/answer_format_rate", "verifier"] == 2  # behaviour on the eval set, per agent
    # The values drawn are the logged ones (the dots' positions read back through the axes' ticks), each dot's
    # hover title gives its value.
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    coach = {g.attrs["data-series"]: g for g in charts["agent/*/coach_score"].find_all("g", "series")}
    for a in agents:
        logged = [(r["step"], r[f"agent/{a}/coach_score"]) for r in rows]
        assert drawn(charts["agent/*/coach_score"])[a, "0"] == pytest.approx(sum(logged, ()), abs=1e-4)
        assert [t.text() for t in coach[a].find_all("title")] == [f"{a}, step {s}: {v:.3g}" for s, v in logged]
    assert drawn(charts["amc_eval_32 (32 problems x 4 samples)"])["accuracy", "0"] == pytest.approx((1, 0.1, 3, 0.3))

    # The newest episode is shown: the hostile reply as text, the coder's tool run, the verifier's failed verdict.
    cards = {c.attrs["data-agent"]: c for c in dom.find_all("div", "action")}
    assert cards["solver"].find_all("pre", "response")[0].text() == HOSTILE and not dom.find_all("img")
    assert cards["solver"].find_all("div", "score")[0].text().startswith("coach score ")
    assert cards["solver"].find_all("pre", "rationale")[0].text().startswith("heuristic: ")
    assert cards["solver"].attrs["style"].startswith("background: rgb(") and "221, 221, 221" not in cards["solver"].attrs["style"]
    assert cards["coder"].find_all("pre", "stdout")[0].text() == "stdout:\n4\n"
    assert cards["verifier"].find_all("div", "score")[0].text() == "no score: parse_error"
    assert "the coach's reply had no score" in cards["verifier"].find_all("pre", "rationale")[0].text()
    assert cards["verifier"].attrs["style"] == "background: rgb(221, 221, 221);"  # grey: no score
    assert "no coach-bias warning" in dom.text()


def ticks(figure, axis) -> list:
    """(label, position) of each tick matplotlib drew on a chart's axis ("x" or "y")."""
    groups = [g for g in figure.find_all("g") if re.fullmatch(axis + r"tick_\d+", g.attrs.get("id", ""))]
    return [(g.find_all("text")[0].text(), float(g.find_all("use")[0].attrs[axis])) for g in groups]


def tick_labels(figure, axis) -> list:
    return [label for label, _ in ticks(figure, axis)]


def from_position(figure, axis, position) -> float:
    """An SVG coordinate on a chart's axis as the value it stands for, through the axis' first and last ticks."""
    (first, at_first), *_, (last, at_last) = ticks(figure, axis)
    return float(first) + (position - at_first) * (float(last) - float(first)) / (at_last - at_first)


def drawn(figure) -> dict:
    """Each series of a chart by (name, run): its dots' (step, value, step, value, ...), read from their positions."""
    return {(g.attrs["data-series"], g.attrs["data-run"]): tuple(from_position(figure, axis, float(u.attrs[axis]))
                                                               for u in g.find_all("use") for axis in ("x", "y"))
            for g in figure.find_all("g", "series")}


def test_report_screenshot_has_ticks_and_opens_with_success_and_coach_scores(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    agents = run_dir_from_a_real_rollout(run_dir, tmp_path)
    page = report.write_report(str(run_dir))
    shot = tmp_path / "report.png"
    chromium(page, "--window-size=1400,1000", f"--screenshot={shot}")
    image = Image.open(shot).convert("RGB")
    assert image.size == (1400, 1000)
    # The first chart's line and dots are drawn in the first series colour (#1f77b4): the charts were painted.
    colours = {c: n for n, c in image.crop((0, 0, 1400, 700)).getcolors(1400 * 700)}
    assert colours.get((31, 119, 180), 0) > 50

    dom = render_report_dom(page)
    charts = dom.find_all("figure", "chart")
    # It opens with the success rate, then each agent's coach score, on their whole scales.
    assert [c.attrs["data-title"] for c in charts[:2]] == ["outcome/success_rate", "agent/*/coach_score"]
    assert tick_labels(charts[0], "y") == ["0.0", "0.2", "0.4", "0.6", "0.8", "1.0"]
    assert tick_labels(charts[1], "y") == ["0", "2", "4", "6", "8", "10"]
    assert tick_labels(charts[0], "x") == ["1", "2", "3"]  # one per step
    assert {g.attrs["data-series"] for g in charts[1].find_all("g", "series")} == set(agents)
    grid = [[p for p in c.find_all("path") if "stroke: #e4e4e4" in p.attrs.get("style", "")] for c in charts]
    assert all(len(lines) >= 4 for lines in grid)  # light gridlines at the ticks
    # A constant series (every action the same length each step) gets an axis from 0 to its value.
    lengths = {json.loads(line)["agent/solver/action_length"] for line in open(run_dir / "metrics.jsonl")}
    assert len(lengths) == 1
    (length,) = lengths
    y = [float(t) for t in tick_labels(next(c for c in charts if c.attrs["data-title"] == "agent/*/action_length"), "y")]
    assert y[0] == 0 < length <= y[-1] and len(y) >= 3, (length, y)


def test_two_runs_overlay(tmp_path):
    # Two real runs of different lengths, both named "run" in directories that tell them apart.
    runs = [tmp_path / "process" / "run", tmp_path / "outcome" / "run"]
    for run_dir, steps in zip(runs, (3, 2)):
        run_dir.mkdir(parents=True)
        agents = run_dir_from_a_real_rollout(run_dir, run_dir.parent, steps=steps)
    proc = subprocess.run([MAPPA, "report", *map(str, runs)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == str(runs[0] / "compare.html"), proc.stderr

    # Self-contained: outside its data (agent text, shown as text only) the page fetches nothing.
    page = open(proc.stdout.strip(), encoding="utf-8").read()
    page = re.sub(r'<script type="application/json" id="data">.*?</script>', "", page, flags=re.S)
    # The charts are matplotlib's SVG inline, their references (a dot's shape, a clip path) within the page.
    assert page.count("<svg") == page.count('<figure class="chart"') > 0
    assert not re.search(r'<(link|img|iframe)|src=|href="[^#]|url\([^#]|import ', page)
    dom = render_report_dom(proc.stdout.strip())
    charts = {f.attrs["data-title"]: f for f in dom.find_all("figure", "chart")}
    for title in ("outcome/success_rate", "agent/*/coach_score", "coach verdicts by status"):
        lines = charts[title].find_all("g", "series")
        points = {}
        for g in lines:
            points.setdefault(g.attrs["data-run"], []).append(len(g.find_all("use")))
        assert set(points["0"]) == {3} and set(points["1"]) == {2}, (title, points)  # each run's own steps
        # One line style per run (solid, then dashed), a legend entry per run and series.
        dashed = {g.attrs["data-run"]: "stroke-dasharray" in g.find_all("path")[0].attrs["style"] for g in lines}
        assert dashed == {"0": False, "1": True}
    legend = next(g for g in charts["agent/*/coach_score"].find_all("g") if g.attrs.get("id") == "legend_1")
    legend = [t.text() for t in legend.find_all("text")]
    assert legend == [f"{run}/run: {a}" for run in ("process", "outcome") for a in agents]
    # Both runs in the header; the viewer lists every episode of both, labelled, with a run filter.
    assert "process/run (solid lines)" in dom.text() and "outcome/run (dashed lines)" in dom.text()
    items = [li.text() for li in dom.find_all("li", "episode")]
    assert len(items) == 12 + 8 and sum(i.startswith("outcome/run | ") for i in items) == 8
    assert [o.text() for o in dom.find_all("select")[0].find_all("option")] == ["all", "process/run", "outcome/run"]


def test_report_shows_the_hindsight_review_and_both_verdicts(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    agents = run_dir_from_a_real_rollout(run_dir, tmp_path, coach_mode="both")
    out = tmp_path / "page.html"
    report.write_report(str(run_dir), out=str(out))
    dom = assert_report_renders(str(out), agents, steps=3, episodes=12)
    charts = {f.attrs["data-title"]: f for f in dom.find_all("figure", "chart")}
    points = {(t, g.attrs["data-series"]): g.find_all("use") for t, f in charts.items()
              for g in f.find_all("g", "series")}
    assert len(points["coach requests per step", "requests"]) == len(points["hindsight reviews by status", "ok"]) == 3
    # The newest episode solved its task: the heuristic coach holds its last action (the verifier's) responsible.
    assert dom.find_all("div", "review")[0].text().startswith("hindsight review (heuristic): action 3 held responsible")
    cards = {c.attrs["data-agent"]: c for c in dom.find_all("div", "action")}
    assert cards["verifier"].find_all("h4")[0].text().endswith("held responsible for the outcome")
    assert "held responsible" not in cards["solver"].find_all("h4")[0].text()
    assert "(per_action " in cards["solver"].find_all("div", "score")[0].text() and ", hindsight " in cards["solver"].find_all("div", "score")[0].text()


def test_a_direct_launch_ends_with_the_report(tmp_path, monkeypatch, capsys):
    # Catches the old launcher, which left the report to the demo script: a run through train_mappa_ray (or
    # `ray job submit`) had no report.html, which the README lists among a run's files. The cluster's part
    # (launch, which starts Ray) stands in: it logs two steps.
    from test_launch import GOOD, write_topology

    from openrlhf_mappa.cli import train_mappa_ray

    for name in ("config.json", "tokenizer.json"):
        (tmp_path / "model").mkdir(exist_ok=True)
        (tmp_path / "model" / name).write_text("{}")
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps({"prompt": f"{i} + 1?", "answer": i + 1}) + "\n"
                                                  for i in range(4)))
    write_topology(tmp_path)
    monkeypatch.chdir(tmp_path)

    def two_steps(args, *rest):
        write_jsonl(tmp_path / "run" / "metrics.jsonl", [metrics_row(1), metrics_row(2)])
        return []

    monkeypatch.setattr(train_mappa_ray, "launch", two_steps)
    train_mappa_ray.train(train_mappa_ray.parse_args([*GOOD, "--mappa.verbose"]))
    page = tmp_path / "run" / "report.html"
    assert f"[mappa] report:      {page}\n" in capsys.readouterr().out
    again = report.write_report(str(tmp_path / "run"), out=str(tmp_path / "again.html"))
    assert page.read_text(encoding="utf-8") == open(again, encoding="utf-8").read()  # `mappa report`'s page
