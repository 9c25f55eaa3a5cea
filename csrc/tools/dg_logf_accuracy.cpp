// Exhaustive accuracy of dg_logf (common/philox.h) against the double-precision log, and of the Gumbel
// transform over every possible u (2^23 values). Built and run by `python build.py --logf-accuracy`
// (about a minute on 2 cores). Prints the max error in ulps (of the correctly rounded float), where it
// occurs, and how many results are not the correctly rounded float; exits 1 if any error exceeds 1 ulp.
//
//   dg_logf_accuracy [hi]   checks every positive float x <= hi (default 32, covering (0, 1] and the range
//                           (0, 16.64] of the Gumbel transform's second log)
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "../common/philox.h"

int main(int argc, char** argv) {
  const float hi = argc > 1 ? strtof(argv[1], nullptr) : 32.0f;
  const uint32_t last = dg::float_to_bits(hi);
  double max_err = 0.0;
  uint32_t worst = 0;
  long long not_cr = 0, over_one = 0;
#pragma omp parallel
  {
    double local_max = 0.0;
    uint32_t local_worst = 0;
    long long local_not_cr = 0, local_over = 0;
#pragma omp for schedule(static)
    for (long long u = 1; u <= (long long)last; ++u) {
      const float x = dg::bits_to_float((uint32_t)u);
      const double exact = log((double)x);
      const float r = dg::dg_logf(x);
      const float cr = (float)exact;
      if (exact == 0.0) {
        if (r != 0.0f) local_over++;
        continue;
      }
      int e;
      frexp((double)cr, &e);
      const double ulp = ldexp(1.0, e - 24);
      const double err = fabs((double)r - exact) / ulp;
      if (err > local_max) {
        local_max = err;
        local_worst = (uint32_t)u;
      }
      local_not_cr += (r != cr);
      local_over += (err > 1.0);
    }
#pragma omp critical
    {
      if (local_max > max_err) {
        max_err = local_max;
        worst = local_worst;
      }
      not_cr += local_not_cr;
      over_one += local_over;
    }
  }
  printf(
      "dg_logf over all %u positive floats <= %g: max error %.4f ulp at x = %a; %lld not correctly rounded "
      "(%.3f%%); %lld above 1 ulp\n",
      last, (double)hi, max_err, (double)dg::bits_to_float(worst), not_cr, 100.0 * not_cr / last, over_one);
  // Gumbel: g depends on r only through j = r >> 9; compare with the chain evaluated in double.
  double gmax_abs = 0.0;
  for (uint32_t j = 0; j < (1u << 23); ++j) {
    const float g = dg::gumbel_from_bits(j << 9);
    const double u = ((double)j + 0.5) * 0x1p-23;
    const double exact = -log(-log(u));
    const double d = fabs((double)g - exact);
    if (d > gmax_abs) gmax_abs = d;
  }
  printf("gumbel over all 2^23 values of u: max |g - g_exact(double)| = %.3g\n", gmax_abs);
  return over_one == 0 ? 0 : 1;
}
