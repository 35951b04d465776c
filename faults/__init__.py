"""The fault-injection harness: scripted faults against a real job, and a report of what survived.

``commslayer-faults list`` shows the scenarios; ``commslayer-faults run
SCENARIO`` (or ``--all``) runs them against ``launch/train.py`` or your job
and writes ``report.json`` and ``report.md``.  From Python::

    from faults.harness import Options, run
    report = run("sigstop", "runs/faults", Options(ranks=4))
    assert report["passed"], report["checks"]

Modules: ``scenarios`` (what each scenario injects and promises),
``inject`` (faults fired from inside the job's processes, the fault log),
``harness`` (running a scenario, the invariants, the reports), ``netns``
(hosts made of network namespaces), ``etcd`` (a local etcd cluster whose
members can be killed and stopped), ``cli``, ``autoload`` (the injector
starts when torch is imported), ``wake`` (the helper that ends a
``sigstop`` fault).  What a run leaves (result files, the fault log,
the summary) is read through ``commslayer.runs``, the definition the
launcher and the training script share; the processes the harness starts
are handled by ``commslayer.run.processes``.
"""
