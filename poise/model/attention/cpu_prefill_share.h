// Which key blocks the chunks of one prefill call share (cpu_prefill_attention.cpp). Chunks
// whose block tables begin with the same cache blocks (the prompt tails after one cached
// document, the requests that follow one prefill, a shared system prompt) read the same keys
// there: each such key block is packed once, for the first chunk that reads it, and the others
// point at that copy. Where those keys lie before every query of the chunks (their cached
// context, so no query is masked there), the chunks' rows also walk those blocks together, as
// stacked items, before each chunk's own items walk the rest of its keys from the online
// softmax state its rows carried out: every step of the walk is per row (one row per vector
// lane), so a row's state after the shared blocks, and its output, is bit for bit what it is
// alone. This is what makes a short tail after a long cached context cheap in this kernel: its
// few rows share one walk of the context with the other tails after it, instead of each
// padding its rows to a whole item and packing the context again.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

namespace poise_prefill {

struct ShareGroup {
  std::vector<int> members;        // chunk indices, in call order
  int64_t shared_blocks = 0;       // key blocks every member's rows walk together
  std::vector<int64_t> row_start;  // member i's rows (queries x G) at [row_start[i], row_start[i + 1])
  int64_t state_offset = 0;        // its rows' state in the state buffer: [kv head][row][hd + 2]
};

struct Sharing {
  std::vector<int64_t> origin;  // per (chunk, kv head, key block): the packed copy it reads
  std::vector<ShareGroup> groups;
  std::vector<int> group_of;         // per chunk: its group, or -1
  std::vector<int64_t> group_row;    // per chunk: where its rows begin among its group's
  int64_t state_floats = 0;          // the state buffer's size
};

// The state (o [hd], m, l) of row `row` of group `grp`, kv head g, in the state buffer.
inline float* row_state(float* state, const ShareGroup& grp, int g, int64_t row, int hd) {
  return state + grp.state_offset + (g * grp.row_start.back() + row) * (hd + 2);
}

// `first_block[c] + g * count_c + b`: chunk c's key block b of kv head g (count_c its key blocks
// per head), as cpu_prefill_attention.cpp numbers them. stack: whether stacked walks may be
// used (the vector path; the AMX path only shares packed blocks). G: query heads per kv head.
template <typename Chunks>
Sharing find_sharing(const Chunks& p, const std::vector<int64_t>& first_block, int keys_per_block,
                     bool stack, int G, int head_dim) {
  Sharing s;
  s.origin.resize(first_block[p.num_chunks]);
  std::iota(s.origin.begin(), s.origin.end(), int64_t{0});
  s.group_of.assign(p.num_chunks, -1);
  s.group_row.assign(p.num_chunks, 0);
  auto context = [&](int c) { return p.start_position[c] + p.query_len[c]; };
  auto count = [&](int c) { return (first_block[c + 1] - first_block[c]) / p.num_kv_heads; };
  // Keys 0 .. n - 1 of chunks a and b are the same cache slots: their tables agree that far.
  auto same_keys = [&](int a, int b) {
    const int64_t keys = std::min(context(a), context(b));
    const int64_t blocks = (keys + p.block_size - 1) / p.block_size;
    const int64_t *ta = p.tables + a * p.table_stride, *tb = p.tables + b * p.table_stride;
    int64_t n = 0;
    while (n < blocks && ta[n] == tb[n]) ++n;
    return std::min(n * p.block_size, keys);
  };
  std::vector<int> roots;       // chunks whose blocks are their own
  std::vector<int> root_group;  // per root: its group, or -1
  for (int c = 0; c < p.num_chunks; ++c) {
    int best = -1;
    int64_t best_blocks = 0;  // whole key blocks shared with roots[best]
    for (size_t i = 0; i < roots.size(); ++i) {
      const int64_t blocks = same_keys(c, roots[i]) / keys_per_block;
      if (blocks > best_blocks) best = static_cast<int>(i), best_blocks = blocks;
    }
    if (best < 0) {
      roots.push_back(c);
      root_group.push_back(-1);
      continue;
    }
    const int r = roots[best];
    for (int g = 0; g < p.num_kv_heads; ++g)
      for (int64_t b = 0; b < best_blocks; ++b)
        s.origin[first_block[c] + g * count(c) + b] = first_block[r] + g * count(r) + b;
    // Stacked: the shared blocks before every query of c (and of the group's other members).
    const int64_t visible = std::min(best_blocks, p.start_position[c] / keys_per_block);
    if (!stack || visible == 0) continue;
    int& gi = root_group[best];
    if (gi < 0) {
      gi = static_cast<int>(s.groups.size());
      s.groups.emplace_back();
      s.groups.back().shared_blocks = visible;
      const int64_t root_visible = p.start_position[r] / keys_per_block;
      if (root_visible > 0) {  // a cold root (its queries in those blocks) walks alone
        s.groups.back().members.push_back(r);
        s.groups.back().shared_blocks = std::min(visible, root_visible);
      }
    }
    ShareGroup& grp = s.groups[gi];
    grp.members.push_back(c);
    grp.shared_blocks = std::min(grp.shared_blocks, visible);
  }
  // A group of one gains nothing from a stacked walk.
  s.groups.erase(std::remove_if(s.groups.begin(), s.groups.end(),
                                [](const ShareGroup& g) { return g.members.size() < 2; }),
                 s.groups.end());
  for (size_t gi = 0; gi < s.groups.size(); ++gi) {
    ShareGroup& grp = s.groups[gi];
    grp.row_start.assign(1, 0);
    for (size_t i = 0; i < grp.members.size(); ++i) {
      s.group_of[grp.members[i]] = static_cast<int>(gi);
      s.group_row[grp.members[i]] = grp.row_start.back();
      grp.row_start.push_back(grp.row_start.back() + p.query_len[grp.members[i]] * G);
    }
    grp.state_offset = s.state_floats;
    s.state_floats += p.num_kv_heads * grp.row_start.back() * (head_dim + 2);
  }
  return s;
}

}  // namespace poise_prefill
