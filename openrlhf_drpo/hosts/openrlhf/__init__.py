"""The OpenRLHF 0.11.2 host: ObjectiveLoss in place of PolicyLoss (loss), the policy actor that
installs it (actor) with log-probs from its hidden states in chunks (logprobs), drpo-train
(train), CPU mode (cpu_mode), PolicyLoss's own options as objectives (options) and a math reward
for --reward.remote_url (reward)."""
