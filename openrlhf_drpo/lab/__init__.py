"""drpo-lab: objectives' training stability compared through the real drpo-train pipeline on a
synthetic task. driver (the command), task and toytask (the task and its tiny model), pipe (the
shared pipeline: drpo-train's plugin, through its named hooks)."""
