"""Stand-in for the eval branch of slime/rollout/sglang_rollout.py at 624b824: `generate_rollout(...,
evaluation=True)` (:641-644) runs `eval_rollout` (:476-487) over ``args.eval_datasets``; without eval
datasets it returns ``RolloutFnEvalOutput(data={})``. Each dataset here is scored without an engine:
its rewards are the dataset's ``rewards`` list (the real one generates on slime's SGLang engines)."""

from slime.rollout.base_types import RolloutFnEvalOutput


def generate_rollout(args, rollout_id, data_source, evaluation=False):
    assert args.rollout_global_dataset
    if not evaluation:
        raise NotImplementedError("the stand-in serves the eval branch only")
    data = {d["name"]: {"rewards": list(d["rewards"])} for d in getattr(args, "eval_datasets", []) or []}
    return RolloutFnEvalOutput(data=data)
