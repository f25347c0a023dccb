"""The training run: setup (phases before step 1), the loop over epochs and steps, the micro-step, the after-a-step
events and the run state they share. See docs/ARCHITECTURE.md, "The training core"."""
