/* The C kernels for CPU serving, float32 (weights also in bf16 and GGUF's blocks): waferscale/serve/kernels.py
   compiles this file, and only this one, into a shared object (see _FLAGS there) and calls its wsc_* functions
   through ctypes. One translation unit:
   the parts below are included, not linked, so that they share their static state (the pool's job, the
   per-thread scratch buffers) and the compiler sees every call across them. */

#define WSC_SERVE_KERNELS_TU
#include "kernels.h"

#include "panels.c"         /* the panel microkernel: y = residual + x W^T + bias, per chunk of panels */
#include "quant.c"          /* the same over bf16 and GGUF's quantized blocks: layout, float path, dispatch */
#include "qint.c"           /* ... their integer path: x as int8 digits, each instruction set's integer dot */
#include "qpack.c"          /* GGUF rows -> quantized panels (packing), rows -> floats (wsc_qrows) */
#include "spanels.c"        /* the same over sparse panels (masks + non-zero values) */
#include "pool.c"           /* the work-stealing pool, wsc_set_threads, wsc_linear */
#include "attention.c"      /* wsc_decode_attention, wsc_decode_attention_batch */
#include "rowwise.c"        /* wsc_silu_mul, wsc_argmax, wsc_argmax_rows, wsc_rms_norm */
#include "decode_layers.c"  /* wsc_decode_layers, wsc_decode_layers_batch */

/* the instruction-set path this build runs (kernels.h): "avx512-vnni", "avx2", "neon-dotprod", "portable", ... */
const char* wsc_kernel_path(void) { return WSC_PATH; }
