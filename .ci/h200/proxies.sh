# Issue 34's two training proxies as `onboard train --set` arguments, sourced by the device scripts
# that run them (call_s.sh, call_w.sh, call_u.sh): WIDTHS, the shared 12-layer hidden-2048 MoE
# proxy (64 experts top-8 of 768); NEXT, what Qwen3-Next adds (GDN heads, shared expert);
# MOE, what Qwen3-MoE adds. Model: hf:qwen3_next with NEXT, hf:qwen3_moe with MOE.
WIDTHS="--set vocab_size=32000 --set hidden_size=2048 --set num_hidden_layers=12 --set num_attention_heads=16 \
  --set num_experts=64 --set num_experts_per_tok=8 --set moe_intermediate_size=768 --set intermediate_size=6144 \
  --set decoder_sparse_step=1"
NEXT="--set num_key_value_heads=2 --set head_dim=128 --set linear_num_key_heads=16 --set linear_num_value_heads=32 \
  --set linear_key_head_dim=64 --set linear_value_head_dim=64 --set shared_expert_intermediate_size=768"
MOE="--set num_key_value_heads=4"
