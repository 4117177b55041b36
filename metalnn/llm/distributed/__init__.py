"""Models larger than one machine: pipeline- and tensor-parallel inference on ``mx.distributed``.

``metalnn.llm.models.load_pretrained(path, pipeline=group)`` gives each rank of ``group`` a contiguous
run of decoder blocks (`pipeline`); ``load_pretrained(path, tensor=group)`` gives each rank a share of
every block's heads and columns (`tensor_parallel`); either way a rank reads only the tensors of its
part (`loader`). Start the ranks with ``mlx.launch`` (``mx.distributed.init()`` gives the group);
every rank then runs the same program (`metalnn.generate`, the server's loop) and gets the same logits.

    group = mx.distributed.init()
    model = load_pretrained("Qwen/Qwen3-8B", pipeline=group)
    text = metalnn.generate(model, prompt, max_new_tokens=64)   # the same on every rank

`launch_group` reads the group ``mlx.launch`` set up (None outside it); `follow_rank` ends a rank when
another dies (see `metalnn.cli`).
"""

from .loader import RankWeights, Shard, TensorReader, gguf_config, read_gguf_part, shard_model
from .pipeline import PipelineLM, PipelinePeer, PipelineStack, pipeline_model, stage_ranges
from .placement import balance, owner
from .runtime import launch_group, parameter_bytes, watch_peers
from .tensor_parallel import shard_tensor

__all__ = ["RankWeights", "Shard", "TensorReader", "gguf_config", "read_gguf_part", "shard_model", "PipelineLM",
           "PipelinePeer", "PipelineStack", "pipeline_model", "stage_ranges", "balance", "owner", "shard_tensor",
           "launch_group", "parameter_bytes", "watch_peers"]
