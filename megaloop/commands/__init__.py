"""The `megaloop` subcommands, one module each: its options (`add_parser`) beside its handler.

Every module declares BUILDS_MODEL: whether the command builds a model in this process (and so
needs megatron-core, and the CPU compatibility layer on a CPU). The others read configs and
print, or hand the work to other processes, and import none of torch, megatron-core or wandb.
A command whose actions differ sets `builds_model` on the action's parser (`eval downstream`).
"""

from megaloop.commands import (
    bench,
    ckpt,
    configs,
    demo,
    depth,
    diagnose,
    eval_,
    export,
    generate,
    halt,
    import_,
    params,
    plan,
    prep,
    report,
    slurm,
    sweep,
    train,
)

COMMANDS = {
    "train": train,
    "params": params,
    "configs": configs,
    "plan": plan,
    "demo": demo,
    "prep": prep,
    "ckpt": ckpt,
    "export": export,
    "import": import_,
    "eval": eval_,
    "bench": bench,
    "generate": generate,
    "depth": depth,
    "halt": halt,
    "diagnose": diagnose,
    "sweep": sweep,
    "report": report,
    "slurm": slurm,
}
"""Each command's name and module, in the order `megaloop --help` lists them."""
