"""Two ranks call every op the hot path takes, in the forms users write, plus forms it must
leave to the general path (async, strided, large summarised bfloat16 pieces):
test_hotpath.py runs it with the hot path on and off and compares the records."""

import warnings

import torch
import torch.distributed as dist

import commcheck

commcheck.patch()
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(rank)
sub = dist.new_group([0, 1])
warnings.simplefilter("ignore", FutureWarning)  # all_gather_into_tensor is deprecated

for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.float16, torch.int64,
              torch.int32, torch.uint8):
    x = (torch.arange(12, dtype=torch.float32) * (rank + 1) - 3).to(dtype).reshape(3, 4)
    dist.all_reduce(x)
    dist.all_reduce(x, op=dist.ReduceOp.MAX, group=sub)
    dist.all_reduce(tensor=x, op=dist.ReduceOp.MIN)
    dist.broadcast(x, src=1)
    dist.broadcast(x, 0, group=sub)
    dist.broadcast(x, group=sub, group_src=1)
    flat = x.reshape(-1)
    out = torch.empty(24, dtype=dtype)
    dist.all_gather_single(out, flat)
    dist.all_gather_into_tensor(out, flat, group=sub)
    odd = torch.empty(10, dtype=dtype)
    dist.all_gather_single(odd, flat[:5].clone())
    parts = [torch.empty(3, 4, dtype=dtype) for _ in range(2)]
    dist.all_gather(parts, x)
    dist.all_gather(tensor_list=parts, tensor=x, group=sub)
    dist.all_gather(list(torch.empty(2, 3, 4, dtype=dtype).unbind(0)), x)  # views of one
    half = torch.empty(12, dtype=dtype)
    dist.reduce_scatter_single(half, out)
    dist.reduce_scatter_single(output=torch.empty(5, dtype=dtype), input=odd,
                               op=dist.ReduceOp.MAX)
    if rank == 0:
        dist.send(x, 1)
        dist.send(x, dst=1, tag=7)
        dist.send(flat[:7].clone(), group=sub, group_dst=1)
    else:
        dist.recv(x, 0)
        dist.recv(x, src=0, tag=7)
        dist.recv(torch.empty(7, dtype=dtype), group=sub, group_src=0)
    commcheck.step()

# the steady state of all_reduce, broadcast and the gathered ops, taken whole in C once
# the hot path learned the group (native/express.c): float dtypes with NaN and Inf, more
# argument forms
for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
    z = (torch.tensor([1.5, -2.0, float("nan"), float("inf")] * 3) * (rank + 1)).to(dtype)
    dist.all_reduce(z.reshape(3, 4))
    dist.all_reduce(z, dist.ReduceOp.MAX)
    dist.broadcast(z, src=0)
    dist.broadcast(tensor=z, src=1, group=None)
    dist.all_gather_single(torch.empty(24, dtype=dtype), z)
    dist.reduce_scatter_single(input=z, output=torch.empty(6, dtype=dtype))
    dist.all_gather([torch.empty(12, dtype=dtype) for _ in range(2)], z)
    commcheck.step()

# beyond one-call sizes: the statistics kernel's sums for an uncut float32 side, the native
# pieces call for a cut one (hashed only, or float32)
for dtype in (torch.float32, torch.bfloat16):
    y = (torch.randn(70001) + rank).to(dtype)
    dist.all_reduce(y)
    dist.broadcast(y, 1)
    dist.all_gather_single(torch.empty(140002, dtype=dtype), y)
    dist.all_gather([torch.empty(70001, dtype=dtype) for _ in range(2)], y)
    dist.reduce_scatter_single(torch.empty(70001, dtype=dtype), torch.randn(140002).to(dtype))
    if rank == 0:
        dist.send(y, 1)
    else:
        dist.recv(y, 0)
# large gathers into the buffer their input is a slice of (FSDP's way), a reduce_scatter
# into a slice of its input, async_op=False given by position: the input is read before the
# call, not while it runs (the others above are read while it runs)
y = torch.randn(70001) + rank
flat = torch.empty(140002)
flat[rank * 70001:(rank + 1) * 70001] = y
dist.all_gather_single(flat, flat[rank * 70001:(rank + 1) * 70001])
dist.all_gather([flat[:70001], flat[70001:]], flat[rank * 70001:(rank + 1) * 70001])
both = torch.randn(140002) + rank
dist.reduce_scatter_single(both[:70001], both)
dist.all_gather_into_tensor(torch.empty(140002), y, None, False)
# a large summarised piece of bfloat16 (torch sums it): the general path
dist.reduce_scatter_single(torch.empty(70001, dtype=torch.bfloat16),
                           torch.randn(140002).to(torch.bfloat16))
dist.all_reduce(y, async_op=True).wait()  # async: the general path
dist.all_reduce(torch.randn(4, 6).t() + rank)  # strided: the general path
dist.barrier()
dist.destroy_process_group()
