"""Stand-ins for the GPU-only parts of verl 0.9.1's fully-async mode (see `rollouts.agent_loop_output`)."""
