"""The params YAML <-> typed dataclasses, in the Cerebras Model Zoo layout (read only by `zoo` and `cli`).

Two layouts are accepted: the legacy sections (`train_input`, `eval_input`, `model`, `optimizer`, `sparsity`,
`runconfig`) and the newer trainer layout (`trainer: {init, fit}`, cszoo), mapped onto the legacy one. Every user
mistake is a ConfigError with the file, line and key path:

    configs/x.yaml:12: optimizer.learning_rate[1].schedular: unknown key 'schedular' (did you mean 'scheduler'?)

Model Zoo keys accepted for compatibility but ignored are listed, with the reason, in each class's
`IGNORED_KEYS`; `Params.ignored` names the ones a file used. Legacy spellings are mapped by `ALIASES`
(`weight_decay_rate` -> `weight_decay`, `save_checkpoint_steps` -> `checkpoint_steps`, scheduler `steps` /
`decay_steps` -> `total_iters`, ...).
"""

from waferscale.errors import ConfigError
from waferscale.params.model import ModelParams
from waferscale.params.schedules import SCHEDULERS, normalize_learning_rate
from waferscale.params.schema import (OPTIMIZERS, InputParams, OptimizerParams, Params, RunConfig, check_batch_split,
                                      load_params, params_from_dict, save_params)
from waferscale.params.typed import FieldError

__all__ = ["ConfigError", "FieldError", "InputParams", "ModelParams", "OptimizerParams", "RunConfig", "Params",
           "SCHEDULERS", "OPTIMIZERS", "normalize_learning_rate", "check_batch_split", "load_params",
           "params_from_dict", "save_params"]
