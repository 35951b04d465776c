"""The recovery story of a job, from the recorders' recovery events.

Per loss (the ``peer_lost`` events of one generation of one communicator
lineage): who was lost, at which step, which survivor saw it when and how
(detection latency: after the lost rank's last traced op when it has one,
else after the first survivor's detection), the decision (the next
generation's members before and after, time from the first detection), the
first op of the new generation and the recovery time (from the first
detection to the end of the first ``should_commit`` after the survivors
were back: the first committed step, which contains the decision; the
first op of the new generation when no commit followed); then every
admission (a generation that grew), the heals of the ranks that rejoined
(each at the step its heal gave it, the boundary it continued at), and
fencing.  ``superseded`` names the communicators of generations the
job recovered from: what failed in them is history, not the job's failure.

Imports neither torch nor commslayer.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Optional, Set, Tuple

from tracing.messages import human_bytes, loss_cause, short_error
from tracing.read.scan_rows import COMPLETED_CODE, END, STATE, WIDTH, arrivals

if TYPE_CHECKING:
    from tracing.read.analysis import JobScan


MERGE_NS = 10 ** 9  # a loss seen on another communicator within this of a recoverable one's is the same loss


_GENERATION = re.compile(r"@g(\d+)")
_LIFE = re.compile(r"@life(\d+)$")  # traceio.life_uid


def lineage(uid: str) -> str:
    """The communicator lineage of uid ``replicas.0@g2/replicate0``: ``replicas.0``."""
    return uid.split("/", 1)[0].split("@g", 1)[0]


def _number(value: Any) -> Any:
    """``value`` if it is a number (a trace is hostile input: anything else reads as absent)."""
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _whole(value: Any) -> Optional[int]:
    """``value`` if it is a whole number >= 0 (an id, a pid), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _ranks(rs: Iterable[int]) -> str:
    rs = sorted(rs)
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))


def _first_ops(scan: "JobScan") -> Dict[Tuple[str, int], int]:
    """(lineage, generation > 0) -> the earliest aligned enqueue of an op in it."""
    first_seq: Dict[str, Tuple[int, int]] = {}
    for comm, gen, seq in scan.collectives:
        if gen and (comm not in first_seq or seq < first_seq[comm][1]):
            first_seq[comm] = (gen, seq)
    out: Dict[Tuple[str, int], int] = {}
    off = {r: c.offset_ns for r, c in scan.offsets.items()}
    for comm, (gen, seq) in first_seq.items():
        a = scan.collectives[(comm, gen, seq)]
        t = min(arrivals(a, off)[1])
        key = (lineage(comm), gen)
        out[key] = min(t, out.get(key, t))
    return out


def _commits(scan: "JobScan") -> Dict[str, List[Tuple[int, int, int, Dict[int, int]]]]:
    """lineage -> (earliest aligned enqueue, latest aligned end, generation, each rank's
    aligned enqueue) of every ``should_commit`` of a generation > 0 that every rank
    recording it completed (a resilient job's step commit, or a vote after a restore), in
    time order."""
    off = {r: c.offset_ns for r, c in scan.offsets.items()}
    out: Dict[str, List[Tuple[int, int, int, Dict[int, int]]]] = {}
    for (comm, gen, seq), a in scan.collectives.items():
        if not gen or scan.coll_ops[(comm, gen, seq)] != "should_commit" or \
                any(s != COMPLETED_CODE for s in a[STATE::WIDTH]):
            continue
        ranks, enq = arrivals(a, off)
        end = max(e - off.get(r, 0) for r, e in zip(ranks, a[END::WIDTH]))
        out.setdefault(lineage(comm), []).append((min(enq), end, gen, dict(zip(ranks, enq))))
    for v in out.values():
        v.sort(key=lambda c: c[:3])
    return out


def recovery_story(scan: "JobScan") -> Dict[str, Any]:
    """The story as plain values: ``losses``, ``admissions``, ``heals``, ``fenced``,
    ``generations`` (bands: each generation of the main lineage from its first op),
    ``markers`` (for timelines), ``lines`` (sentences), ``recovered`` (every loss
    was followed by a new generation that ran ops) and ``superseded`` (uids)."""
    events = scan.events
    by_kind: Dict[str, List[Dict[str, Any]]] = {}
    for ev in events:
        by_kind.setdefault(ev["kind"], []).append(ev)
    gens: Dict[Tuple[str, int], List[Dict[str, Any]]] = {}  # (lineage, generation) -> generation events
    for ev in by_kind.get("generation", ()):
        gens.setdefault((lineage(ev.get("comm_id") or ""), ev.get("generation") or 0), []).append(ev)
    first_ops = _first_ops(scan) if events else {}
    commits = _commits(scan) if by_kind.get("peer_lost") else {}
    losses: List[Dict[str, Any]] = []
    groups: Dict[Tuple[str, int], List[Dict[str, Any]]] = {}
    resizable = {lin for lin, _ in gens}
    others = []
    for ev in by_kind.get("peer_lost", ()):
        lin = lineage(ev.get("comm_id") or "")
        if lin in resizable:
            groups.setdefault((lin, ev.get("generation") or 0), []).append(ev)
        else:
            others.append(ev)
    for ev in others:  # a group that does not recover by itself: part of the loss around it, if any
        around = [k for k, evs in groups.items() if k[0] in resizable and abs(min(e["t_ns"] for e in evs) - ev["t_ns"]) < MERGE_NS]
        groups.setdefault(around[0] if around else (lineage(ev.get("comm_id") or ""), ev.get("generation") or 0),
                          []).append(ev)
    for (lin, gen), evs in sorted(groups.items(), key=lambda kv: min(e["t_ns"] for e in kv[1])):
        lost = sorted({r for e in evs for r in e.get("lost") or ()})
        seen: Dict[int, Dict[str, Any]] = {}
        for e in sorted(evs, key=lambda e: e["t_ns"]):
            seen.setdefault(e["rank"], e)
        first = min(e["t_ns"] for e in evs)
        last_signs = [scan.life_end(r, first) for r in lost]
        known = [t for t in last_signs if t is not None]
        base = max(known) if last_signs and len(known) == len(last_signs) else None
        steps = [e["step"] for e in evs if e.get("step") is not None]
        later = [e for e in by_kind.get("recovered", ()) if (e.get("generation") or 0) > gen]
        # the survivors' report of this loss (a reconfigure after the shrink may have made it gen + 2)
        recovered = [e for e in later if e.get("generation") == min(x.get("generation") or 0 for x in later)]
        if recovered:
            steps = [e["step"] for e in recovered]
        decision = gens.get((lin, gen + 1), [])
        after = next((e["members"] for e in decision if e.get("members") is not None), None)
        before = next((e["before"] for e in decision if e.get("before") is not None), None)
        if before is not None and after is not None:  # those that left with the lost (their replica group)
            lost = sorted(set(lost) | (set(before) - set(after)))
        resume = first_ops.get((lin, gen + 1))
        # Recovered: the first step committed after the survivors were back (their ``recovered``
        # events; else the new generation's first op), on the same axis as the detection and the
        # decision, so that it contains both (the events' own ``seconds`` count from each
        # survivor's entry into its recovery, which can come well after the first detection).
        # A commit counts once each survivor that reported its recovery entered it after that
        # report (a restore's own vote comes before it); without reports, after the first op.
        back = {e["rank"]: e["t_ns"] for e in recovered}
        commit = None if resume is None else next(
            ((t, end, g) for t, end, g, enq in commits.get(lin, ())
             if g > gen and t >= resume and all(enq.get(r, t) >= b for r, b in back.items())), None)
        redo = [e["redo_from"] for e in recovered if _number(e.get("redo_from")) is not None]
        losses.append({
            "lineage": lin, "generation": gen, "lost": lost, "step": min(steps) if steps else None,
            "lost_replicas": recovered[0].get("lost_replicas") if recovered else None,
            "t_ns": first, "detection_base": "last traced op" if base is not None else "first detection",
            "detections": [{"rank": r, "t_ns": e["t_ns"], "latency_s": (e["t_ns"] - (base or first)) / 1e9,
                            "how": loss_cause(e.get("error")), "error": e.get("error"), "comm": e.get("comm")}
                           for r, e in sorted(seen.items())],
            "decision_generation": gen + 1 if decision else None, "members_before": before, "members_after": after,
            "decision_s": None if not decision else (min(e["t_ns"] for e in decision) - first) / 1e9,
            "resume_s": None if resume is None else (resume - first) / 1e9,
            "redo_from": min(redo) if redo else None,
            "recovered_ns": commit[1] if commit else resume, "recovered_by": "first commit" if commit else
            "first op" if resume is not None else None, "commit_generation": commit[2] if commit else None,
            "recovered": resume is not None,
        })
    losses = _chained(losses)
    for loss in losses:
        t = loss.pop("recovered_ns")
        loss["recovery_s"] = None if t is None else (t - loss["t_ns"]) / 1e9
    admissions = []
    heals = [{"rank": e["rank"], "t_ns": e["t_ns"], "step": e.get("step"), "generation": e.get("generation"),
              "source": e.get("source"), "source_replica": e.get("source_replica"), "bytes": _number(e.get("bytes")),
              "seconds": _number(e.get("seconds")), "spare": _whole(e.get("spare")), "pid": _whole(e.get("pid")),
              "restarted": scan.life_of(e["rank"], e["t_ns"]) > 0}
             for e in sorted(by_kind.get("healed", ()), key=lambda e: e["t_ns"])]
    for (lin, gen), evs in sorted(gens.items()):
        before = next((e["before"] for e in evs if e.get("before") is not None), None)
        after = next((e["members"] for e in evs if e.get("members") is not None), None)
        if before is None or after is None or not set(after) - set(before):
            continue
        joined = sorted(set(after) - set(before))
        adm = [e for e in by_kind.get("admitted", ()) if e.get("generation") == gen]
        admissions.append({"lineage": lin, "generation": gen, "joined": joined, "members_before": before,
                           "members_after": after, "t_ns": min(e["t_ns"] for e in evs),
                           "step": adm[0].get("step") if adm else None,
                           "continued_at": min((h["step"] for h in heals if h["generation"] == gen
                                                and h["rank"] in joined and h["step"] is not None), default=None),
                           "seconds": max((_number(e.get("seconds")) or 0 for e in adm), default=None) if adm else None,
                           "heals": [h for h in heals if h["generation"] == gen and h["rank"] in joined]})
    fenced = [{"rank": e["rank"], "t_ns": e["t_ns"], "comm": e.get("comm"), "why": e.get("why")}
              for e in by_kind.get("fenced", ())]
    superseded: Set[str] = set()
    last_life = {r: src.last_life.life for r, src in scan.sources.items()}
    for uid in scan.communicators:  # a communicator of a life that ended: every member was restarted after it
        m = _LIFE.search(uid)
        life = int(m.group(1)) if m else 0
        members = scan.members(uid)
        if members and all(last_life.get(r, -1) > life for r in members if r in scan.sources):
            if any(r in scan.sources for r in members):
                superseded.add(uid)
    if losses:
        for uid in set(scan.communicators) | {k[0] for k in scan.collectives}:
            lin = lineage(uid)
            m = _GENERATION.search(uid)
            gen = int(m.group(1)) if m else 0
            if any(loss["lineage"] == lin and loss["recovered"] and loss["generation"] >= gen for loss in losses):
                superseded.add(uid)
    main = losses[0]["lineage"] if losses else next((lin for lin, _ in sorted(gens)), None)
    t0, t1 = scan.span()
    starts = [(0, t0)] + sorted((g, t) for (lin, g), t in first_ops.items() if lin == main)
    bands = [{"generation": g, "start_ns": t, "end_ns": starts[i + 1][1] if i + 1 < len(starts) else t1}
             for i, (g, t) in enumerate(starts)] if len(starts) > 1 else []
    return {"losses": losses, "admissions": admissions, "heals": heals, "fenced": fenced, "generations": bands,
            "recovered": bool(losses) and all(loss["recovered"] for loss in losses),
            "superseded": sorted(superseded), "lines": _lines(losses, admissions, fenced),
            "markers": _markers(losses, admissions, fenced)}


def _chained(losses: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One loss per recovery: a loss whose decided generation lost a member before its
    first op (a replica group's second rank, ended by its torchrun a moment after the
    first died) is told with the later loss, from the first detection to the resume."""
    out: List[Dict[str, Any]] = []
    for loss in losses:  # in time order
        prior = next((p for p in out if p["lineage"] == loss["lineage"] and not p["recovered"]
                      and p["decision_generation"] == loss["generation"]), None)
        if prior is None:
            out.append(loss)
            continue
        shift = (loss["t_ns"] - prior["t_ns"]) / 1e9
        steps = [s for s in (prior["step"], loss["step"]) if s is not None]
        merged = dict(loss, t_ns=prior["t_ns"], lost=sorted(set(prior["lost"]) | set(loss["lost"])),
                      step=min(steps) if steps else None, lost_replicas=loss["lost_replicas"] or prior["lost_replicas"],
                      detection_base=prior["detection_base"], detections=prior["detections"] + loss["detections"],
                      members_before=prior["members_before"] or loss["members_before"])
        for key in ("decision_s", "resume_s"):
            merged[key] = None if loss[key] is None else loss[key] + shift
        out[out.index(prior)] = merged  # recovered_ns: the later loss's, now timed from the prior's detection
    return out


def _lines(losses: List[Dict[str, Any]], admissions: List[Dict[str, Any]], fenced: List[Dict[str, Any]]) -> List[str]:
    out = []
    for loss in losses:
        at = "" if loss["step"] is None else f" at step {loss['step']}"
        group = "" if not loss["lost_replicas"] else \
            f" (replica group{'s' if len(loss['lost_replicas']) > 1 else ''} " \
            f"{', '.join(map(str, loss['lost_replicas']))})"
        if loss["recovered"]:
            took = "" if loss["recovery_s"] is None else f" in {loss['recovery_s']:.3f} s"
            members = "" if loss["members_after"] is None else f": {_ranks(loss['members_after'])}"
            back = "" if loss["redo_from"] is None or loss["redo_from"] == loss["step"] else \
                f"; back to step {loss['redo_from']}"
            text = (f"The job lost {_ranks(loss['lost'])}{group}{at} and recovered{took} "
                    f"(generation {loss['decision_generation']}{members}{back})")
        else:
            text = f"The job lost {_ranks(loss['lost'])}{group}{at} and did not resume in a new generation"
        out.append(text)
    for adm in admissions:
        heals = {h["rank"]: h for h in adm["heals"]}
        for r in adm["joined"]:
            h = heals.get(r)
            # the step it continued at: its heal's (the boundary it received), which is the one it
            # printed; the survivors' admission names the step they were in (before going back)
            step = h["step"] if h and h["step"] is not None else adm["step"]
            at = "" if step is None else f" at step {step}"
            how = "" if not h or not h["restarted"] else " after a restart" if h["spare"] is None else \
                f", replaced by warm spare {h['spare']}" + ("" if h["pid"] is None else f" (pid {h['pid']})")
            took = "" if not h or h["seconds"] is None else f" (heal {h['seconds']:.3f} s" + (
                "" if h["bytes"] is None else f", {human_bytes(h['bytes'])} from rank {h['source']}"
                + ("" if h["source_replica"] is None else f" of replica group {h['source_replica']}")) + ")"
            out.append(f"rank {r} rejoined{at}{how}{took}, generation {adm['generation']}")
    for f in fenced:
        out.append(f"rank {f['rank']} was fenced out of '{f['comm']}': {short_error(f['why'])}")
    return out


def recovered_text(loss: Dict[str, Any]) -> str:
    """``recovered in 4.719 s (to the first step committed after it, generation 2, redone
    from step 19)``: a loss's recovery time and what it runs to ("" when unknown)."""
    if loss["recovery_s"] is None:
        return ""
    if loss.get("recovered_by") != "first commit":
        return f"recovered in {loss['recovery_s']:.3f} s (to that first op)"
    redo = "" if loss.get("redo_from") is None else f", redone from step {loss['redo_from']}"
    return (f"recovered in {loss['recovery_s']:.3f} s (to the first step committed after it, generation "
            f"{loss['commit_generation']}{redo})")


def _markers(losses: List[Dict[str, Any]], admissions: List[Dict[str, Any]],
             fenced: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Instants to draw across every rank row: kind, aligned time (ns), label."""
    out = []
    for loss in losses:
        out.append({"kind": "loss", "t_ns": loss["t_ns"], "label": f"{_ranks(loss['lost'])} lost"})
        if loss["decision_s"] is not None:
            out.append({"kind": "decision", "t_ns": loss["t_ns"] + int(loss["decision_s"] * 1e9),
                        "label": f"generation {loss['decision_generation']} decided"})
        if loss["resume_s"] is not None:
            out.append({"kind": "resume", "t_ns": loss["t_ns"] + int(loss["resume_s"] * 1e9),
                        "label": f"generation {loss['decision_generation']}: first op"})
    for adm in admissions:
        out.append({"kind": "admit", "t_ns": adm["t_ns"],
                    "label": f"{_ranks(adm['joined'])} admitted (generation {adm['generation']})"})
    for f in fenced:
        out.append({"kind": "fenced", "t_ns": f["t_ns"], "label": f"rank {f['rank']} fenced"})
    return sorted(out, key=lambda m: m["t_ns"])
