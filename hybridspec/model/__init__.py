"""The target model as the runtime runs it: weights packed for this machine's products (`linear`), the KV cache
(`kv_cache`), a pass's inputs and outputs (`inputs`), its attention and rotary embedding with the CPU kernel of steps
(`attention`, `attention_kernel.h`), the greedy output layer (`head`), the layers and the forward pass over packed
parts (`target`), the costs measured once per machine (`calibration`, `machine`) and loading the embedded model
(`loading`).

Nothing here knows proposers or calls: it runs tokens and returns logits and hidden states.
"""
