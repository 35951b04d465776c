"""A resilient job that makes one mistake with the resilience API, chosen by argv[1]:

``extra-state``  replica 1 registers one object more than replica 0;
``shape``        replica 1's registered counter has another shape;
``no-grads``     the loop calls ``job.step()`` without a backward pass;
``no-step``      the loop never calls ``job.step()``;
``no-optimizer``  only the model is registered;
``other-model``   the optimizer was built over another model's parameters;
``scheduler``     an LR scheduler drives the optimizer but is not registered.

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
    torch.manual_seed(0)
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
    job.register(**state)
    for step in job.steps(5):
        loss = model(torch.ones(2, 4)).sum()
        if mistake != "no-grads":
            loss.backward()
        if mistake != "no-step":
            job.step(loss)
    job.finish()


if __name__ == "__main__":
    main()
