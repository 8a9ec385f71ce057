// Precompiled header: <torch/torch.h> alone takes ~17 s to parse on the 2-core CI machine.
#pragma once
#include <torch/torch.h>
