// The Python binding of FlashMLA's sm90 dense decode alone (scripts/flashmla_setup.py builds it as
// flash_mla.cuda): FlashMLA's own api.cpp also binds its sparse and sm100 kernels, which are not
// built here. flash_mla/flash_mla_interface.py calls `dense_decode_fwd` for dense attention.
#include <pybind11/pybind11.h>

#include "api/dense_decode.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "FlashMLA sm90 dense decode (deepseek-pd build)";
    m.def("dense_decode_fwd", &dense_attn_decode_interface);
}
