"""Starting dtrain's ranks: on one machine, `python -m dtrain.run --nproc-per-node N` (local.py);
on several nodes, `python -m dtrain.launch slurm ...` inside a SLURM allocation (tools/slurm.sbatch
runs it), which starts `python -m dtrain.launch node ...` on every node."""
