// Where in the user's program a torch call was made: the innermost Python
// frame outside torch and cpsim ("step.py:12"), named in every report.
#pragma once
#include <string>
#include <vector>

namespace cpsim::torch_backend {

// The folders of torch's and cpsim's own Python files (cpsim.torch sets them).
std::vector<std::string>& internal_paths();
// What a call made under cpsim's own Python code is part of (the harness's
// backward of a step's output), per thread; "" when unset. The frames outside
// that code (the program that called the harness) are not the call's site.
std::string& site_context();
// The folder of cpsim's own Python files.
std::string& own_path();

// Where the program made the call: the innermost Python frame outside torch and
// cpsim ("step.py:12"), else the thread's site context, or "" (a call from C++).
std::string python_call_site();

}  // namespace cpsim::torch_backend
