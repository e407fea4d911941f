#include "runtime/flat_map.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace ptdp {

void FlatMap::map(int64_t lo, int64_t hi, Ptr base) {
  if (hi <= lo) return;
  auto it = std::lower_bound(pieces_.begin(), pieces_.end(), lo,
                             [](const Piece& p, int64_t v) { return p.lo < v; });
  if ((it != pieces_.end() && it->lo < hi) || (it != pieces_.begin() && std::prev(it)->hi > lo))
    throw std::logic_error("FlatMap: [" + std::to_string(lo) + ", " + std::to_string(hi) +
                           ") overlaps a mapped range");
  pieces_.insert(it, Piece{lo, hi, base});
}

void FlatMap::unmap(int64_t lo) {
  auto it = std::lower_bound(pieces_.begin(), pieces_.end(), lo,
                             [](const Piece& p, int64_t v) { return p.lo < v; });
  if (it == pieces_.end() || it->lo != lo)
    throw std::logic_error("FlatMap: nothing is mapped from " + std::to_string(lo));
  pieces_.erase(it);
}

const FlatMap::Piece* FlatMap::find(int64_t off) const {
  // The last piece starting at or before off.
  auto it = std::upper_bound(pieces_.begin(), pieces_.end(), off,
                             [](int64_t v, const Piece& p) { return v < p.lo; });
  if (it == pieces_.begin()) return nullptr;
  const Piece& p = *std::prev(it);
  return off < p.hi ? &p : nullptr;
}

void FlatMap::overlay(int64_t lo, int64_t hi, Ptr base) {
  if (hi <= lo) return;
  for (const Piece& p : overlays_)
    if (p.lo < hi && lo < p.hi)
      throw std::logic_error("FlatMap: a window over [" + std::to_string(lo) + ", " +
                             std::to_string(hi) + ") overlaps another");
  overlays_.push_back(Piece{lo, hi, base});
}

void FlatMap::remove_overlay(int64_t lo) {
  auto it =
      std::find_if(overlays_.begin(), overlays_.end(), [lo](const Piece& p) { return p.lo == lo; });
  if (it == overlays_.end())
    throw std::logic_error("FlatMap: no window starts at " + std::to_string(lo));
  overlays_.erase(it);
}

Ptr FlatMap::at(int64_t off) const {
  for (const Piece& p : overlays_)
    if (off >= p.lo && off < p.hi) return p.base.at(off - p.lo);
  return held_at(off);
}

Ptr FlatMap::held_at(int64_t off) const {
  if (pieces_.size() == 1 && off >= pieces_[0].lo && off < pieces_[0].hi)
    return pieces_[0].base.at(off - pieces_[0].lo);
  const Piece* p = find(off);
  if (!p) throw std::logic_error("FlatMap: element " + std::to_string(off) + " is not held here");
  return p->base.at(off - p->lo);
}

bool FlatMap::holds(int64_t lo, int64_t hi) const {
  if (hi <= lo) return true;
  const Piece* p = find(lo);
  return p && hi <= p->hi;
}

}  // namespace ptdp
