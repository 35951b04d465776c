"""A resilient job that makes one mistake with the resilience API, chosen by argv[1]:

``extra-state``  replica 1 registers one object more than replica 0;
``shape``        replica 1's registered counter has another shape;
``no-grads``     the loop calls ``job.step()`` without a backward pass;
``no-step``      the loop never calls ``job.step()``;
``no-optimizer``  only the model is registered;
``other-model``   the optimizer was built over another model's parameters;
``scheduler``     an LR scheduler drives the optimizer but is not registered;
``same-optimizer``  the optimizer is registered twice, under two names;
``submodule``     the model and a module wrapping it are both registered;
``two-optimizers``  a second optimizer over the same parameters is registered;
``uneven-steps``  replica 1 loops over fewer steps than replica 0;
``seed``          each replica seeds its model differently;
``epochs``        the loop over ``job.steps()`` runs again for a second epoch;
``loss-item``     ``job.step(loss.item())``: a float, not the loss tensor;
``same-data``     every replica group reads the same data (a warning: the replicas add nothing);
``no-steps``      ``job.steps(0)``: a job of no steps (``--steps 0``);
``opt-step``      the plain script's ``opt.step()`` left in the loop, before ``job.step()``;
``diverge``       replica 1 edits its parameters at step 2, outside ``job.step()`` (as loading a
                  checkpoint on one replica would).

Anything else (``none``) makes no mistake: each member reads its own data.

Each must end every rank with a clear error, not a hang or a silent divergence.
"""

import sys

import torch
import torch.nn as nn

from commslayer import resilience


class Counter:
    def __init__(self, n: int) -> None:
        self.value = torch.zeros(n)

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def main() -> None:
    mistake = sys.argv[1]
    job = resilience.init()
    torch.manual_seed(job.replica if mistake == "seed" else 0)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD((nn.Linear(4, 4) if mistake == "other-model" else model).parameters(), lr=0.1)
    if mistake == "scheduler":
        torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    state = {"model": model, "optimizer": opt,
             "counter": Counter(4 if mistake == "shape" and job.replica == 1 else 3)}
    if mistake == "no-optimizer":
        del state["optimizer"]
    if mistake == "extra-state" and job.replica == 1:
        state["extra"] = Counter(2)
    state.update(twice(mistake, model, opt))
    job.register(**state)
    for _ in range(2 if mistake == "epochs" else 1):
        for step in job.steps(0 if mistake == "no-steps" else 4 if mistake == "uneven-steps" and job.replica == 1
                              else 5):
            if mistake == "diverge" and step == 2 and job.replica == 1:
                with torch.no_grad():
                    model.weight.add_(1.0)
            loss = model(torch.ones(2, 4) * (1 if mistake == "same-data" else job.member + 1)).sum()
            if mistake != "no-grads":
                loss.backward()
            if mistake == "opt-step":
                opt.step()
            if mistake != "no-step":
                job.step(loss.item() if mistake == "loss-item" else loss)
    job.finish()


def twice(mistake: str, model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """What the mistakes that register something twice register beside the model and optimizer."""
    if mistake == "same-optimizer":
        return {"opt2": opt}
    if mistake == "submodule":
        return {"wrapped": nn.Sequential(model)}
    if mistake == "two-optimizers":
        return {"opt2": torch.optim.SGD(model.parameters(), lr=0.1)}
    return {}


if __name__ == "__main__":
    main()
