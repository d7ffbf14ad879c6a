// Cooperative launch: grid.sync() between two phases over the whole grid.
#include <cooperative_groups.h>
namespace cg = cooperative_groups;

extern "C" __global__ void mb_coop_probe(unsigned int* data, unsigned int* out) {
  cg::grid_group g = cg::this_grid();
  const unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
  data[i] = i + 1u;
  g.sync();
  const unsigned int n = gridDim.x * blockDim.x;
  out[i] = data[(i + 1u) % n];
}
