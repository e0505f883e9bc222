// Validity rules of a forward-kernel configuration, as static_asserts.
//
// Mirrors flash_attention/configs.py validity_errors() rule for rule (same wording). Plain C++ with no device
// code, so tests/test_configs.py can compile it with the host compiler for thousands of candidate configs
// at once and check that both sides accept and reject exactly the same ones.
#pragma once

namespace fa {

// Whether a config's inputs are e4m3 (FP8): only e4m3 configs name kIsE4M3 (configs.forward.cpp_struct),
// so every 16-bit config's struct is unchanged.
template <class Cfg, class = void>
struct CfgIsE4M3 {
  static constexpr bool value = false;
};
template <class Cfg>
struct CfgIsE4M3<Cfg, decltype(void(Cfg::kIsE4M3))> {
  static constexpr bool value = Cfg::kIsE4M3;
};

template <class Cfg>
struct check_config {
  static constexpr int D = Cfg::kHeadDim;
  static constexpr int DV = Cfg::kHeadDimV;
  // The warps that own query rows: a warp-specialized block's producer warpgroup owns none.
  static constexpr int W = Cfg::kWarpSpecialized ? Cfg::kNumWarps - 4 : Cfg::kNumWarps;
  static constexpr bool kE4M3 = CfgIsE4M3<Cfg>::value;
  static_assert(D == 64 || D == 128 || D == 192 || D == 256, "head_dim must be one of (64, 128, 192, 256)");
  // e4m3: head_dim 64 or 128 on 128- or 256-key tiles; head_dim 256 on 64-key tiles only (its 128-key
  // builds spilled 352-516 bytes; configs.forward.validity_errors says the same).
  static_assert(!kE4M3 || (Cfg::kWarpSpecialized && Cfg::kPersistent && DV == D &&
                           (((D == 64 || D == 128) && (Cfg::kBlockKV == 128 || Cfg::kBlockKV == 256)) ||
                            (D == 256 && Cfg::kBlockKV == 64))),
                "e4m3 needs the persistent warp-specialized forward, head_dim 64 or 128 on block_kv 128 or "
                "256, or head_dim 256 on block_kv 64, and v of q's head_dim");
  static_assert(DV == D || (Cfg::kWarpSpecialized && DV % 64 == 0 && DV >= 64 && DV < D),
                "head_dim_v other than head_dim needs warp_specialized, a multiple of 64 below head_dim");
  static_assert(!Cfg::kWarpSpecialized ||
                    (Cfg::kWgmma && Cfg::kStages >= 2 && Cfg::kNumWarps == 4 + Cfg::kBlockQ / 16),
                "warp_specialized needs wgmma, stages >= 2 and num_warps = 4 + block_q / 16 (a producer "
                "warpgroup besides the consumers)");
  static_assert(!Cfg::kOverlap || Cfg::kWarpSpecialized, "overlap needs warp_specialized");
  static_assert(!Cfg::kPingpong || (Cfg::kWarpSpecialized && Cfg::kBlockQ == 128),
                "pingpong needs warp_specialized with two consumer warpgroups (block_q 128)");
  static_assert(!Cfg::kPersistent || Cfg::kWarpSpecialized, "persistent needs warp_specialized");
  static_assert(!Cfg::kTmaStore || Cfg::kWarpSpecialized, "tma_store needs warp_specialized");
  static_assert(!Cfg::kTileOverlap || (Cfg::kPersistent && Cfg::kOverlap && !Cfg::kPingpong),
                "tile_overlap needs persistent and overlap, without pingpong");
  static_assert(Cfg::kExpPoly >= 0 && Cfg::kExpPoly <= 8,
                "exp_poly counts eighths of the exponentials: 0 to 8");
  static_assert(Cfg::kExpPoly == 0 || Cfg::kWarpSpecialized,
                "exp_poly is the warp-specialized forward's (fwd_ws)");
  static_assert(W == 1 || W == 2 || W == 4 || W == 8 || (Cfg::kWarpSpecialized && W == 12),
                "num_warps must be 1, 2, 4 or 8 (12 consumer warps beside a warp-specialized producer)");
  static_assert(Cfg::kBlockQ % (16 * W) == 0,
                "block_q must be a multiple of 16 * num_warps (each warp owns whole 16-row mma tiles)");
  static_assert(
      Cfg::kBlockQ / W <= 64,
      "block_q / num_warps must be at most 64 (the accumulators of more rows exceed the registers)");
  static_assert(!Cfg::kWarpSpecialized ||
                    (Cfg::kBlockKV % 16 == 0 && Cfg::kBlockKV >= 16 && Cfg::kBlockKV <= 256),
                "block_kv of a warp-specialized config must be a multiple of 16 from 16 to 256");
  static_assert(Cfg::kWarpSpecialized || Cfg::kBlockKV == 16 || Cfg::kBlockKV == 32 || Cfg::kBlockKV == 64 ||
                    Cfg::kBlockKV == 128 || Cfg::kBlockKV == 256,
                "block_kv must be 16, 32, 64, 128 or 256");
  static_assert(!Cfg::kEager || Cfg::kAsyncCopy,
                "eager loading needs async_copy (a plain load would stall the warp that issues it)");
  static_assert(Cfg::kQFrags >= 0 && (Cfg::kQFrags == 0 || (D / 16) % Cfg::kQFrags == 0),
                "q_frags must be 0 or divide head_dim / 16");
  static_assert(Cfg::kKFrags >= 0 && (Cfg::kKFrags == 0 || (D / 16) % Cfg::kKFrags == 0),
                "k_frags must be 0 or divide head_dim / 16");
  static_assert(Cfg::kVFrags >= 0 && (Cfg::kVFrags == 0 || (Cfg::kBlockKV / 16) % Cfg::kVFrags == 0),
                "v_frags must be 0 or divide block_kv / 16");
  static constexpr int kKGroups = Cfg::kKFrags == 0 ? 1 : (D / 16) / Cfg::kKFrags;
  static constexpr int kVGroups = Cfg::kVFrags == 0 ? 1 : (Cfg::kBlockKV / 16) / Cfg::kVFrags;
  static_assert(!Cfg::kDoubleBuffer || kKGroups > 1 || kVGroups > 1,
                "double_buffer needs more than one fragment group of K or V (k_frags or v_frags smaller than "
                "all)");
  static_assert(
      !Cfg::kWgmma || ((W == 4 || W == 8 || W == 12) && Cfg::kBlockQ == 16 * W),
      "wgmma needs num_warps 4 or 8 (12 warp-specialized) and block_q = 16 * num_warps (each warpgroup of 4 "
      "warps owns 64 query rows)");
  static_assert(
      !Cfg::kWgmma ||
          (Cfg::kAsyncCopy && Cfg::kEager && Cfg::kSwizzle && Cfg::kOptSoftmax && Cfg::kQFrags == 0 &&
           Cfg::kKFrags == 0 && Cfg::kVFrags == 0 && !Cfg::kDoubleBuffer && !Cfg::kReverseKV),
      "wgmma fixes async+eager+swizzled+opt_softmax with no fragment loads, double buffer or reverse");
  static_assert(!Cfg::kWgmma || (Cfg::kStages >= 1 && Cfg::kStages <= 4), "stages must be 1, 2, 3 or 4");
  static_assert(Cfg::kWgmma || Cfg::kStages == 1,
                "stages other than 1 need wgmma (the sm80 kernel has one K and one V buffer)");
  // A wgmma config's tiles start on a 1024-byte boundary: 1 KB more for rounding the window up; a
  // warp-specialized one keeps its ring's mbarriers after the tiles (256 bytes), a persistent one stages
  // its output in a tile of its own, and one with tile_overlap has two Q buffers.
  // e4m3: 1-byte Q, K and V tiles (its output, bf16, in the persistent grid's tile).
  static constexpr int kSmemBytes = (kE4M3 ? 1 : 2) * (D * Cfg::kBlockQ * (Cfg::kTileOverlap ? 2 : 1) +
                                                       (D + DV) * Cfg::kBlockKV * Cfg::kStages) +
                                    2 * DV * (Cfg::kPersistent ? Cfg::kBlockQ : 0) +
                                    (Cfg::kWgmma ? 1024 : 0) + (Cfg::kWarpSpecialized ? 256 : 0);
  static_assert(Cfg::kWgmma || kSmemBytes <= 163 * 1024, "shared memory exceeds the sm_80 limit of 166912");
  static_assert(!Cfg::kWgmma || kSmemBytes <= 227 * 1024, "shared memory exceeds the sm_90 limit of 232448");
  static constexpr bool ok = true;
};

}  // namespace fa
