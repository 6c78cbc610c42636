"""The parse stage: capture the proxy's ATen op graph (torch.export, or per-module dispatch when
export fails), and classify its blocks by structure into the block vocabulary (`opgraph.json`)."""
