// Registers metalnn's im2col / col2im primitives (im2col.cpp) in the module.
#pragma once

#include <nanobind/nanobind.h>

void register_im2col(nanobind::module_& m);
