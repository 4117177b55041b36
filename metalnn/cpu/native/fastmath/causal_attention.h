// Registers the native causal attention (causal_attention.cpp) in the module.
#pragma once

#include <nanobind/nanobind.h>

void register_causal_attention(nanobind::module_& m);
