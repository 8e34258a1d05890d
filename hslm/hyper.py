"""The training hyper-parameters: one table, from which the Hyper record, the CLI's
options, the validation and the .state's "hyper" field are all derived.

Each entry says the name, type, default, the smallest allowed value (and whether
it is excluded) and the help text. loss_positions' default, None, means the
window; its upper bound, the window, is checked against the config. These are
exactly the values that decide a run's bytes besides the config and the text.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, make_dataclass

from .config import canonical_json


@dataclass(frozen=True)
class HyperParam:
    name: str
    type: type
    default: object
    low: float            # the smallest allowed value ...
    low_excluded: bool    # ... or the bound it must exceed (lr > 0)
    help: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


HYPER_PARAMS = (
    HyperParam("batch", int, 8, 1, False, "Windows per step."),
    HyperParam("loss_positions", int, None, 1, False,
               "Scored positions k at the end of each window [default: the window]."),
    HyperParam("lr", float, 1e-3, 0.0, True, "Peak learning rate."),
    HyperParam("warmup", int, 100, 0, False, "Linear warm-up steps."),
    HyperParam("decay_steps", int, 10000, 1, False,
               "Step at which the cosine decay reaches 10% of the peak (the schedule does not "
               "depend on --steps)."),
    HyperParam("weight_decay", float, 0.01, 0.0, False,
               "Decoupled weight decay of the ternary latent matrices (times --lr, below 1)."),
    HyperParam("seed", int, 0, 0, False,
               "Seed of the parameters' initialisation and of the training windows."),
    HyperParam("eval_windows", int, 64, 1, False,
               "Validation windows for the validation loss (at most as many as the validation "
               "split holds)."),
)
HYPER_NAMES = tuple(p.name for p in HYPER_PARAMS)


def _to_json(self) -> str:
    return canonical_json(asdict(self))


# Everything besides the config and the text that decides a run's bytes (stored in .state).
Hyper = make_dataclass(
    "Hyper", [(p.name, p.type, field(default=p.default)) for p in HYPER_PARAMS],
    namespace={"to_json": _to_json, "__doc__": "The training hyper-parameters (HYPER_PARAMS)."})
