// FlatMap: where each element of a shard's flat parameter (or gradient) array lives. The flat
// array is the model's layout (ParamInfo::offset); its elements are held in one or more
// pieces of memory, each mapping a range [lo, hi) of it. Without Megatron-FSDP one piece maps
// the whole array (the shard's contiguous buffer). With it (runtime/fsdp.h) the buffer holds
// this rank's shard and what stays whole, and a layer's weights and gradients are mapped while
// its passes run, from windows gathered or opened for them.
#pragma once

#include <cstdint>
#include <vector>

#include "runtime/typed_ptr.h"

namespace ptdp {

class FlatMap {
 public:
  // Maps [lo, hi) to the elements from `base` on. The range must not overlap a mapped one.
  void map(int64_t lo, int64_t hi, Ptr base);
  // Removes the range mapped from lo.
  void unmap(int64_t lo);
  // Maps [lo, hi) to `base` above what is mapped (it may overlap it, not another overlay): a
  // window of a layer's weights or gradients, which at() finds first while it is there;
  // for_each_mapped and holds see only what map() mapped.
  void overlay(int64_t lo, int64_t hi, Ptr base);
  void remove_overlay(int64_t lo);
  // Where element `off` is held (std::logic_error when it is not mapped): in a window over it,
  // else in a piece; held_at looks in the pieces only.
  Ptr at(int64_t off) const;
  Ptr held_at(int64_t off) const;
  // Whether [lo, hi) is mapped, and in one piece (so that at(lo) reaches all of it).
  bool holds(int64_t lo, int64_t hi) const;
  // Calls f(lo, hi, base) for the mapped parts of [lo, hi), in order.
  template <class F>
  void for_each_mapped(int64_t lo, int64_t hi, F&& f) const {
    for (const Piece& p : pieces_) {
      const int64_t a = lo > p.lo ? lo : p.lo, b = hi < p.hi ? hi : p.hi;
      if (a < b) f(a, b, p.base.at(a - p.lo));
    }
  }

 private:
  struct Piece {
    int64_t lo = 0, hi = 0;
    Ptr base;
  };
  // The piece holding `off`, or null.
  const Piece* find(int64_t off) const;
  std::vector<Piece> pieces_;    // sorted by lo, disjoint
  std::vector<Piece> overlays_;  // disjoint, few (the windows of the layers running)
};

}  // namespace ptdp
